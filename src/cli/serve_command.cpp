#include "cli/serve_command.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netinet/in.h>
#include <unistd.h>

#include <array>
#include <cctype>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <memory>
#include <stdexcept>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <spdlog/spdlog.h>

#include "comm/launch/launcher.h"
#include "comm/store/etcd_server.h"
#include "comm/store/store.h"
#include "comm/store/run_keys.h"
#include "cli/watch_command.h"
#include "comm/link/relay.h"
#include "comm/view/view_server.h"
#include "util/error_text.h"
#include "util/files.h"
#include "util/human.h"
#include "util/parse_number.h"
#include "util/run_token.h"
#include "util/stop_signal.h"

namespace noloco {

namespace fs = std::filesystem;

namespace {

// The first IPv4 address of this machine that is not loopback.
std::string first_address() {
  ifaddrs* all = nullptr;
  if (::getifaddrs(&all) != 0) return "";
  std::string found;
  for (const ifaddrs* a = all; a && found.empty(); a = a->ifa_next) {
    if (!a->ifa_addr || a->ifa_addr->sa_family != AF_INET) continue;
    char text[INET_ADDRSTRLEN] = {};
    ::inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(a->ifa_addr)->sin_addr, text, sizeof(text));
    if (std::string(text).rfind("127.", 0) != 0) found = text;
  }
  ::freeifaddrs(all);
  return found;
}

// The network namespace this process runs in ("4026531840"; empty if it
// cannot tell): a serve on the same port in another (a container, a test's
// namespace) is another serve.
std::string network_namespace() {
  std::array<char, 64> link{};
  const auto n = ::readlink("/proc/self/ns/net", link.data(), link.size() - 1);
  std::string id;
  for (ssize_t i = 0; i < n; ++i)
    if (std::isdigit(static_cast<unsigned char>(link[size_t(i)]))) id += link[size_t(i)];
  return id;
}

// Where a serve that minted its run's token keeps it, owner-only: the same
// command run again (after a crash or a kill) takes that run back instead of
// minting another, which every worker would refuse. Named by the port and
// the network namespace, as the serve is; under $XDG_STATE_HOME (or
// ~/.local/state), where it outlives a reboot as a store_dir= on disk does.
std::string kept_token_file(const ServeArgs& a) {
  std::string root;
  if (const char* state = std::getenv("XDG_STATE_HOME"); state && *state)
    root = std::string(state) + "/noloco";
  else if (const char* home = std::getenv("HOME"); home && *home)
    root = std::string(home) + "/.local/state/noloco";
  else
    root = EtcdServer::temp_root() + fmt::format("/noloco-state-{}", ::getuid());
  const auto network = network_namespace();
  return network.empty() ? fmt::format("{}/serve-{}.token", root, a.port)
                         : fmt::format("{}/serve-{}-net{}.token", root, a.port, network);
}

// The run's token: NOLOCO_RUN_TOKEN, else the one this serve's command kept,
// else a fresh one, kept. `kept` says whether it is this serve's to remove.
std::string serve_token(const ServeArgs& a, bool* kept) {
  *kept = false;
  if (const auto given = run_token_in_environment()) return *given;
  const auto file = kept_token_file(a);
  *kept = true;
  if (file_exists(file)) {
    const auto token = run_token_of(file, "serve");
    spdlog::info("serve: taking back the run whose token it minted (kept in {}; a serve stopped with Ctrl-C or "
                 "SIGTERM ends its run and removes it)",
                 file);
    return token;
  }
  const auto token = new_run_token();
  std::error_code ec;
  fs::create_directories(fs::path(file).parent_path(), ec);
  if (ec) throw std::runtime_error(fmt::format("serve: cannot create {}: {}", fs::path(file).parent_path().string(),
                                               ec.message()));
  fs::permissions(fs::path(file).parent_path(), fs::perms::owner_all, fs::perm_options::replace, ec);
  write_file_atomic(file, token + "\n", 0600);
  return token;
}

struct ClusterEntry {
  std::string host;
  int port = 0;
};

// Where workers and pages reach an entry's store member.
std::string store_url(const ClusterEntry& e) { return fmt::format("https://{}:{}", e.host, e.port); }

// cluster= parsed: IPv4 addresses (the members' certificate names them), no entry twice.
std::vector<ClusterEntry> cluster_of(const ServeArgs& a) {
  std::vector<ClusterEntry> entries;
  for (size_t start = 0; !a.cluster.empty() && start <= a.cluster.size();) {
    const size_t comma = std::min(a.cluster.find(',', start), a.cluster.size());
    const auto entry = a.cluster.substr(start, comma - start);
    start = comma + 1;
    // Each member takes PORT to PORT+2.
    const auto member = parse_host_port("serve: cluster entry", entry, 65533);
    in_addr ignored{};
    if (!member.port || ::inet_pton(AF_INET, member.host.c_str(), &ignored) != 1)
      throw std::invalid_argument(fmt::format("serve: cluster entry '{}' is not IPV4_ADDRESS:PORT", entry));
    const int port = *member.port;
    for (const auto& e : entries)
      if (e.host == member.host && std::abs(e.port - port) < 3)
        throw std::invalid_argument(fmt::format("serve: cluster entries {}:{} and '{}' share ports (each takes PORT "
                                                "to PORT+2)",
                                                e.host, e.port, entry));
    entries.push_back({member.host, port});
  }
  return entries;
}

void check(const ServeArgs& a) {
  const auto port_ok = [](int p) { return p > 0 && p <= 65535; };
  if (!port_ok(a.relay_port) || (a.store && !port_ok(a.port)))
    throw std::invalid_argument(fmt::format("serve: port={} and relay_port={} must be in [1, 65535]", a.port,
                                            a.relay_port));
  if (a.store && a.port == a.relay_port)
    throw std::invalid_argument(fmt::format("serve: port and relay_port are both {}", a.port));
  in_addr ignored{};
  if (::inet_pton(AF_INET, a.bind.c_str(), &ignored) != 1)
    throw std::invalid_argument(fmt::format("serve: bind={} is not an IPv4 address", a.bind));
  if (a.cluster.empty()) return;
  if (!a.store) throw std::invalid_argument("serve: cluster= is for serves that hold the store (store=true)");
  if (a.relay_port != a.port + 1)
    throw std::invalid_argument(fmt::format("serve: in a cluster each relay is at its store's port + 1 ({}), not "
                                            "relay_port={}",
                                            a.port + 1, a.relay_port));
  if (cluster_of(a).size() < 2)
    throw std::invalid_argument("serve: cluster= names every serve of the cluster (at least 2; 3 survive a death)");
}

// This serve's place in cluster=: the entry at its address and port.
size_t cluster_index(const std::vector<ClusterEntry>& entries, const std::string& host, int port) {
  for (size_t i = 0; i < entries.size(); ++i)
    if (entries[i].host == host && entries[i].port == port) return i;
  throw std::invalid_argument(
      fmt::format("serve: cluster= does not list this serve ({}:{}); set advertise= to its address there", host, port));
}

}  // namespace

Options serve_options(ServeArgs& a) {
  Options options("serve");
  options.add("bind", a.bind, "the address to listen on (IPv4)")
      .add("advertise", a.advertise, "the address workers reach this machine at (empty: bind, or its first address)")
      .add("port", a.port, "the store's port")
      .add("relay_port", a.relay_port, "the relay's port")
      .add("store", a.store, "host the run's store (false: a second relay for a run another serve holds)")
      .add("cluster", a.cluster,
           "IPV4:PORT,... every serve of a store cluster, this one included, same list on each (store port; relay "
           "at PORT+1, etcd peers at PORT+2); the token from NOLOCO_RUN_TOKEN")
      .add("store_dir", a.store_dir,
           "keep the store's data here: the same serve command run again (after a crash, a kill, a reboot if it is "
           "on disk) takes the run back, with the token it minted and kept (or NOLOCO_RUN_TOKEN); empty: a "
           "temporary one, removed with the kept token when this serve is stopped (a cluster's member: removed "
           "with it)")
      .add("view", a.view, "serve the run's live page (with store=true), its URL printed after the exports")
      .add("view_bind", a.view_bind, "the address the live page listens on (loopback unless told otherwise)")
      .add("view_port", a.view_port, "the live page's port (0: a free one)");
  return options;
}

std::vector<std::string> serve_exports(const std::string& token, const ServeArgs& a, const std::string& host) {
  std::vector<std::string> lines{fmt::format("export NOLOCO_RUN_TOKEN={}", token)};
  const auto cluster = cluster_of(a);
  if (cluster.empty()) {
    if (!a.store) {
      // Another serve holds the store: this relay is added to its workers' list, not put in its place.
      lines.push_back(fmt::format("export NOLOCO_RELAY=\"${{NOLOCO_RELAY:+$NOLOCO_RELAY,}}{}:{}\"", host, a.relay_port));
      return lines;
    }
    lines.push_back(fmt::format("export NOLOCO_STORE=https://{}:{}", host, a.port));
    lines.push_back(fmt::format("export NOLOCO_RELAY={}:{}", host, a.relay_port));
    return lines;
  }
  std::vector<std::string> stores, relays;
  for (const auto& e : cluster) {
    stores.push_back(store_url(e));
    relays.push_back(fmt::format("{}:{}", e.host, e.port + 1));
  }
  lines.push_back(fmt::format("export NOLOCO_STORE={}", fmt::join(stores, ",")));
  lines.push_back(fmt::format("export NOLOCO_RELAY={}", fmt::join(relays, ",")));
  return lines;
}

namespace {

// The store's etcd: one of its own, or this serve's member of cluster=.
std::unique_ptr<EtcdServer> host_store(const ServeArgs& a, const std::string& host, const std::string& token,
                                       const std::string& data_dir) {
  const auto cluster = cluster_of(a);
  if (cluster.empty()) {
    const auto tls = store_tls_key(token);
    return std::make_unique<EtcdServer>(a.bind, a.port, store_password(token), &tls, stop_signalled, nullptr,
                                        data_dir);
  }
  const size_t me = cluster_index(cluster, host, a.port);
  std::vector<std::string> addresses, members;
  for (size_t i = 0; i < cluster.size(); ++i) {
    addresses.push_back(cluster[i].host);
    members.push_back(fmt::format("serve{}=https://{}:{}", i, cluster[i].host, cluster[i].port + 2));
  }
  EtcdClusterMember member;
  member.name = fmt::format("serve{}", me);
  member.members = fmt::format("{}", fmt::join(members, ","));
  member.listen_peer_url = fmt::format("https://{}:{}", a.bind, a.port + 2);
  member.peer_url = fmt::format("https://{}:{}", host, a.port + 2);
  member.cluster_token = "noloco-" + store_key_prefix(token);
  spdlog::info("serve: member {} of a store cluster of {}; up once {} of them are", me, cluster.size(),
               cluster.size() / 2 + 1);
  const auto tls = store_tls_key(token, addresses);
  return std::make_unique<EtcdServer>(a.bind, a.port, store_password(token), &tls, stop_signalled, &member, data_dir);
}

// Where the store keeps its data: store_dir=, else one named by the run
// (from its token, the name telling nothing of it) and the port, so that
// the same command run again finds it. A cluster's member keeps none unless
// told (empty: a private one, gone with it): a member restarted on old data
// is refused by a cluster formed anew ("already bootstrapped").
std::string store_data_dir(const ServeArgs& a, const std::string& token) {
  if (!a.store_dir.empty()) return a.store_dir;
  if (!a.cluster.empty()) return "";
  const auto key = run_key(token, "serve store directory");
  return fmt::format("{}/noloco-store-{:02x}-{}", EtcdServer::temp_root(), fmt::join(key.begin(), key.begin() + 6, ""),
                     a.port);
}

// A serve stopped on purpose ends its run: the store's data and the token
// it kept go, unless store_dir= asked to keep them.
void end_run(const ServeArgs& a, const std::string& data_dir, bool token_kept) {
  if (!a.store_dir.empty()) return;
  std::error_code ec;
  if (!data_dir.empty()) fs::remove_all(data_dir, ec);
  if (token_kept) fs::remove(kept_token_file(a), ec);
}

// The run's page, reading the store this serve hosts (in a cluster, this
// serve's member first, then any other that answers); none where it cannot
// listen (serving the run matters more).
struct LivePage {
  std::unique_ptr<RunWatch> watch;
  std::unique_ptr<ViewServer> server;
};
LivePage live_page(const ServeArgs& a, const EtcdServer* store, const std::string& host, const std::string& token) {
  LivePage page;
  if (!store || !a.view) return page;
  std::vector<std::string> endpoints{store->endpoint()};
  for (const auto& e : cluster_of(a))
    if (e.host != host || e.port != a.port) endpoints.push_back(store_url(e));
  try {
    page.watch = std::make_unique<RunWatch>(
        [token](const std::string& at) { return connect_to_run_store(at, token, std::chrono::seconds(5)); },
        fmt::format("{}", fmt::join(endpoints, ",")), token);
    page.server = std::make_unique<ViewServer>(a.view_bind, a.view_port, view_key(token),
                                               [watch = page.watch.get()] { return watch->state(); });
    std::cout << page.server->url() << std::endl;
  } catch (const std::exception& e) {
    spdlog::warn("serve: no live page: {}", error_text(e));
  }
  return page;
}

// Waits for SIGTERM or SIGINT. When this serve's etcd ends by itself, a
// store of its own is started again on its data (its workers train on
// meanwhile); a cluster's member is left to the others, and said so once.
// The relay goes on either way.
int serve_until_stopped(EtcdServer* store, bool in_cluster) {
  bool given_up = false;
  for (;;) {
    if (const int signal = wait_for_stop(std::chrono::milliseconds(500))) return signal;
    if (given_up || !store) continue;
    if (in_cluster) {
      const auto how = store->exited();
      if (!how) continue;
      spdlog::error("serve: this machine's store member (etcd) {}: the run's store goes on at the cluster's other "
                    "members while they hold a majority",
                    *how);
      given_up = true;
      continue;
    }
    given_up = !store->restart_if_ended("serve: ", "the relay goes on");
  }
}

}  // namespace

int store_password_command() {
  const auto token = run_token_in_environment();
  if (!token) throw std::invalid_argument("store-password: set NOLOCO_RUN_TOKEN to the run's token");
  std::cout << store_password(*token) << std::endl;
  return 0;
}

int serve_command(const std::vector<std::string>& args) {
  ServeArgs a;
  serve_options(a).parse(args);
  check(a);
  const auto host = !a.advertise.empty() ? a.advertise : a.bind != "0.0.0.0" ? a.bind : first_address();
  if (host.empty()) throw std::runtime_error("serve: this machine has no IPv4 address but loopback; set advertise=");
  if (!a.cluster.empty() && !run_token_in_environment())
    throw std::invalid_argument("serve: a cluster's serves share one token: set NOLOCO_RUN_TOKEN, the same on each");
  if (!a.store && !run_token_in_environment())
    throw std::invalid_argument("serve: store=false relays for a run another serve holds: set NOLOCO_RUN_TOKEN to "
                                "the token that serve printed");
  bool token_kept = false;
  const auto token = serve_token(a, &token_kept);
  stop_on_signal();
  std::unique_ptr<EtcdServer> store;
  const auto data_dir = store_data_dir(a, token);
  try {
    if (a.store) store = host_store(a, host, token, data_dir);
  } catch (const Interrupted&) {
    spdlog::info("serve: stopped by signal while its store cluster formed");
    end_run(a, data_dir, token_kept);
    return 0;
  } catch (...) {
    std::error_code ec;
    if (!data_dir.empty()) fs::remove(data_dir, ec);  // only while empty: a store that never started
    throw;
  }
  RelayServer relay(a.bind, a.relay_port, run_key(token, "relay"));
  for (const auto& line : serve_exports(token, a, host)) std::cout << line << "\n";
  std::cout.flush();
  if (a.store)
    spdlog::info("serving the run's store on {}:{} and its relay on {}:{} until SIGTERM or Ctrl-C: give each worker "
                 "the export lines above, with RANK and WORLD_SIZE (or noloco join) and bind=its own address",
                 a.bind, a.port, a.bind, relay.port());
  else
    spdlog::info("serving a second relay on {}:{} until SIGTERM or Ctrl-C: run the NOLOCO_RELAY line above after the "
                 "store's serve's lines, on each worker (it adds this relay to that serve's; NOLOCO_STORE stays)",
                 a.bind, relay.port());
  if (store && !data_dir.empty())
    spdlog::info("serve: the store's data is in {}{}: this command run again takes the run back after a crash or a "
                 "kill",
                 data_dir, a.store_dir.empty() ? " until Ctrl-C or SIGTERM" : "");
  int signal = 0;
  {
    const auto page = live_page(a, store.get(), host, token);
    signal = serve_until_stopped(store.get(), !a.cluster.empty());
  }
  const auto s = relay.stats();
  spdlog::info("serve: stopped by signal {}; the relay joined {} pairs and carried {}, refused {} connections", signal,
               s.spliced, format_bytes(double(s.bytes)), s.refused);
  store.reset();
  end_run(a, data_dir, token_kept);
  return 0;
}

}  // namespace noloco
