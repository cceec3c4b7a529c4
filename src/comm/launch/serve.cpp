#include "comm/launch/serve.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <netinet/in.h>
#include <signal.h>
#include <sodium.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <iostream>
#include <memory>
#include <stdexcept>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "comm/store/etcd_server.h"
#include "comm/store/run_keys.h"
#include "comm/transport/relay.h"
#include "util/human.h"

namespace noloco {

namespace {

// SIGTERM and SIGINT end serve through a handler that hands the signal to
// the main thread. Blocked and taken with sigwait() they raced with
// threads that never blocked them (started when libraries load): `timeout`
// sends a second SIGTERM to its process group, and about one stop in ten
// killed serve before it logged what its relay carried.
int stop_pipe[2] = {-1, -1};

void stop_on_signal() {
  if (::pipe2(stop_pipe, O_CLOEXEC) != 0) throw std::runtime_error("serve: no pipe for its stop signal");
  struct sigaction sa {};
  sa.sa_handler = [](int signal) {
    const char s = char(signal);
    (void)!::write(stop_pipe[1], &s, 1);
  };
  sa.sa_flags = SA_RESTART;
  ::sigemptyset(&sa.sa_mask);
  ::sigaction(SIGTERM, &sa, nullptr);
  ::sigaction(SIGINT, &sa, nullptr);
}

int wait_for_stop() {
  for (;;) {
    char s = 0;
    const auto n = ::read(stop_pipe[0], &s, 1);
    if (n == 1) return s;
    if (n < 0 && errno == EINTR) continue;
    return 0;
  }
}

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

// The run's token: NOLOCO_RUN_TOKEN, or a fresh one (256 random bits).
std::string run_token() {
  if (const char* given = std::getenv("NOLOCO_RUN_TOKEN"); given && *given) return given;
  if (sodium_init() < 0) throw std::runtime_error("serve: libsodium did not initialise");
  uint8_t bytes[32];
  randombytes_buf(bytes, sizeof(bytes));
  char hex[2 * sizeof(bytes) + 1];
  sodium_bin2hex(hex, sizeof(hex), bytes, sizeof(bytes));
  return hex;
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
}

}  // namespace

Options serve_options(ServeArgs& a) {
  Options options("serve");
  options.add("bind", a.bind, "the address to listen on (IPv4)")
      .add("advertise", a.advertise, "the address workers reach this machine at (empty: bind, or its first address)")
      .add("port", a.port, "the store's port")
      .add("relay_port", a.relay_port, "the relay's port")
      .add("store", a.store, "host the run's store (false: a second relay for a run another serve holds)");
  return options;
}

std::vector<std::string> serve_exports(const std::string& token, const ServeArgs& a, const std::string& host) {
  std::vector<std::string> lines{fmt::format("export NOLOCO_RUN_TOKEN={}", token)};
  if (a.store) lines.push_back(fmt::format("export NOLOCO_STORE=https://{}:{}", host, a.port));
  lines.push_back(fmt::format("export NOLOCO_RELAY={}:{}", host, a.relay_port));
  return lines;
}

int store_password_command() {
  const char* token = std::getenv("NOLOCO_RUN_TOKEN");
  if (!token || !*token) throw std::invalid_argument("store-password: set NOLOCO_RUN_TOKEN to the run's token");
  std::cout << store_password(token) << std::endl;
  return 0;
}

int serve_command(const std::vector<std::string>& args) {
  ServeArgs a;
  serve_options(a).parse(args);
  check(a);
  const auto host = !a.advertise.empty() ? a.advertise : a.bind != "0.0.0.0" ? a.bind : first_address();
  if (host.empty()) throw std::runtime_error("serve: this machine has no IPv4 address but loopback; set advertise=");
  const auto token = run_token();
  std::unique_ptr<EtcdServer> store;
  if (a.store) {
    const auto tls = store_tls_key(token);
    store = std::make_unique<EtcdServer>(a.bind, a.port, store_password(token), &tls);
  }
  stop_on_signal();
  RelayServer relay(a.bind, a.relay_port, run_key(token, "relay"));
  for (const auto& line : serve_exports(token, a, host)) std::cout << line << "\n";
  std::cout.flush();
  spdlog::info("serving {} until SIGTERM or Ctrl-C: give each worker the export lines above, with RANK and "
               "WORLD_SIZE (or noloco join) and bind=its own address",
               a.store ? fmt::format("the run's store on {}:{} and its relay on {}:{}", a.bind, a.port, a.bind,
                                     relay.port())
                       : fmt::format("a relay on {}:{}", a.bind, relay.port()));
  const int signal = wait_for_stop();
  const auto s = relay.stats();
  spdlog::info("serve: stopped by signal {}; the relay joined {} pairs and carried {}, refused {} connections", signal,
               s.spliced, format_bytes(double(s.bytes)), s.refused);
  return 0;
}

}  // namespace noloco
