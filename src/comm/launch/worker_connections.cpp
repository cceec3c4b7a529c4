#include "comm/launch/worker_connections.h"

#include <netinet/in.h>

#include <algorithm>
#include <stdexcept>
#include <thread>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <spdlog/spdlog.h>

#include "comm/store/run_keys.h"
#include "comm/store/store_outage.h"
#include "comm/transport/nccl_collectives.h"
#include "config/run_layout.h"
#include "comm/transport/seal.h"
#include "util/error_text.h"
#include "util/parse_number.h"
#include "util/process_stats.h"

namespace noloco {

namespace {

bool on_loopback(const std::string& host) {
  return host.rfind("127.", 0) == 0 || host == "localhost" || host == "::1" || host == "[::1]";
}

// The host of each endpoint of a store URL (a cluster's, comma-separated), with its scheme.
std::vector<std::pair<std::string, std::string>> store_hosts(const std::string& urls) {
  std::vector<std::pair<std::string, std::string>> hosts;
  for (const auto& url : comma_separated(urls)) {
    const auto scheme_end = url.find("://");
    if (scheme_end == std::string::npos) continue;
    const auto rest = url.substr(scheme_end + 3);
    const auto host_end = !rest.empty() && rest[0] == '[' ? rest.find(']') + 1 : rest.find_first_of(":/");
    hosts.emplace_back(url.substr(0, scheme_end), rest.substr(0, host_end));
  }
  return hosts;
}

// Plain HTTP that leaves the machine: an http:// endpoint off loopback.
bool in_clear_off_machine(const std::string& urls) {
  for (const auto& [scheme, host] : store_hosts(urls))
    if (scheme == "http" && !on_loopback(host)) return true;
  return false;
}

// seal=false sends the weights, and the password the store's client sends,
// in clear: only where none of it leaves the machine (a run noloco's launcher
// started, whose store is a unix socket, or every address on loopback), unless
// the user accepts it with insecure=true.
void check_unsealed_stays_local(const WorkerEnv& env, const CommConfig& comm) {
  if (comm.seal || comm.insecure || env.store_url.rfind("unix://", 0) == 0) return;
  std::vector<std::string> off;
  if (!on_loopback(comm.bind)) off.push_back("bind=" + comm.bind);
  if (env.store_url.empty() && !on_loopback(env.master_addr)) off.push_back("MASTER_ADDR=" + env.master_addr);
  for (const auto& [scheme, host] : store_hosts(env.store_url))
    if (!on_loopback(host)) off.push_back("NOLOCO_STORE's " + host);
  if (!off.empty())
    throw std::invalid_argument(fmt::format(
        "seal=false off loopback ({}) would send the weights and the store's password in clear: seal the traffic, "
        "keep every address on loopback, or set insecure=true to accept that",
        fmt::join(off, ", ")));
}

// Where this worker's links start: its listening port (listen_port, each
// local worker the next one up, reached at advertise when set: a forwarded
// port, a public address) and the relays of NOLOCO_RELAY.
std::shared_ptr<LinkEndpoint> open_link_endpoint(const WorkerEnv& env, const CommConfig& comm) {
  LinkEndpointOptions options;
  options.bind = comm.bind;
  options.sealed = comm.seal;
  if (!comm.uplink.empty()) options.uplink = parse_bit_rate("uplink", comm.uplink);
  options.port = comm.listen_port > 0 ? int(comm.listen_port) + env.local_rank : 0;
  options.advertise = comm.advertise;
  if (const auto advertised = comm.advertise.empty() ? HostPort{} : parse_host_port("advertise", comm.advertise);
      advertised.port) {
    const int port = *advertised.port + env.local_rank;
    options.advertise = fmt::format("{}:{}", advertised.host, port);
    if (options.port == 0) options.port = port;
  }
  if ((comm.listen_port > 0 || !comm.advertise.empty()) && env.token.empty())
    throw std::runtime_error("listen_port and advertise need the run's token (NOLOCO_RUN_TOKEN)");
  options.relays = comma_separated(env.relays);
  auto endpoint = std::make_shared<LinkEndpoint>(options, run_key(env.token, "link"), run_key(env.token, "relay"));
  if (!options.advertise.empty() || options.port != 0)
    spdlog::info("other workers reach this one's links at {} (listening at {}:{})", endpoint->addresses().listen,
                 comm.bind, endpoint->port());
  return endpoint;
}

}  // namespace

void outlast_store_users(const WorkerConnections& links) {
  if (!links.hosted_store) return;
  for (bool told = false; links.membership; told = true) {
    std::vector<int> others;
    try {
      others = links.membership->still_training();
    } catch (const StoreUnreachable&) {  // its own store is gone: nobody is left to serve
      break;
    }
    if (others.empty()) break;
    if (!told)
      spdlog::info("waiting for {} to finish: this worker hosts the run's store", fmt::join(others, ", "));
    std::this_thread::sleep_for(std::chrono::seconds(1));
  }
  try {
    if (links.hosted_status) let_watchers_catch_up(*links.hosted_status, std::chrono::seconds(2));
  } catch (const std::exception& e) {
    spdlog::debug("the run's watchers may miss its last status: {}", error_text(e));
  }
}

bool uses_nccl(const std::string& configured_device, const CommConfig& comm) {
  return nccl_built() && configured_device == "cuda" && !comm.seal;
}

WorkerConnections join_as_worker(const WorkerEnv& env, const CommConfig& comm, int stages, bool outer_method,
                                 int replica_workers, const std::string& nccl_device) {
  check_unsealed_stays_local(env, comm);
  const auto timeout = std::chrono::milliseconds(int64_t(comm.peer_timeout * 1000));
  const RunLayout layout(stages, replica_workers);
  const int stage = layout.stage_of(env.rank), replica = layout.replica_of(env.rank);
  const int replicas = env.world / layout.workers_per_replica(), replica_worker = layout.replica_worker_of(env.rank);
  WorkerConnections links;
  links.timeout = timeout;
  auto client = env;
  // An https store named without a CA of its own is one a worker or `noloco serve` hosts: pin its token-derived key.
  pin_hosted_store_key(client);
  if (env.store_url.empty() && !env.agent_store) {
    // The store crosses the network: over TLS, every worker pinning the key
    // that the token gives (comm/store/run_keys.h), unless sealing is off.
    const auto tls = store_tls_key(env.token);
    if (comm.seal) client.store_pin = tls.pin;
    if (env.rank == 0) {
      links.hosted_store =
          std::make_unique<EtcdServer>(comm.bind, env.master_port, store_password(env.token), comm.seal ? &tls : nullptr);
      client.store_url = links.hosted_store->endpoint();
      if (comm.live_status) links.hosted_status = run_scope(connect_store(client, timeout), env.token, record::kStatus);
    } else {
      client.store_url = fmt::format("{}://{}:{}", comm.seal ? "https" : "http", env.master_addr, env.master_port);
    }
  } else if (comm.seal && in_clear_off_machine(client.store_url)) {
    throw std::runtime_error(fmt::format(
        "NOLOCO_STORE={}: the store's traffic would cross the network in clear; use https:// with NOLOCO_STORE_CA "
        "(docs/several-machines.md), or seal=false",
        client.store_url));
  }
  const auto connect = [client, timeout] { return connect_store(client, timeout); };
  links.store = connect();
  links.heartbeat = std::make_unique<Heartbeat>(connect(), env.token, env.rank);
  if (comm.seal) links.seal = std::make_shared<const Seal>(env.token);
  // The replica's workers wait for each other while the first exchanges,
  // evaluates or checkpoints, which may take longer than peer_timeout; a dead
  // one closes its connections (a hung one is killed for its heartbeat), so
  // the wait can be long without holding up a lost replica.
  const auto replica_timeout = std::max<std::chrono::milliseconds>(timeout, std::chrono::minutes(30));
  // Restarted whole, a replica forms its group anew: the last one's keys belong to dead processes.
  const auto replica_name = record::replica_workers(replica, env.restart);
  if (replica_workers > 1 && !nccl_device.empty())
    links.replica_group = join_nccl_group(run_scope(connect(), env.token, replica_name), "nccl", replica_worker,
                                          replica_workers, nccl_device, replica_timeout);
  else if (replica_workers > 1)
    links.replica_group = std::make_unique<GlooTransport>(connect, env, replica_name, replica_worker, replica_workers,
                                                          comm.bind, replica_timeout, links.seal);
  const bool crosses_sites = (outer_method && replica_worker == 0) || stages > 1;
  if (crosses_sites) links.endpoint = open_link_endpoint(env, comm);
  if (outer_method && replica_worker == 0) {
    const auto scope = record::replica_group(stages, stage);
    links.membership = std::make_unique<Membership>(connect(), env, scope, replica, replicas,
                                                    std::chrono::milliseconds(int64_t(comm.heartbeat_timeout * 1000)),
                                                    timeout, links.heartbeat.get(),
                                                    [layout, stage](int member) { return layout.speaker(member, stage); });
    links.transport = std::make_unique<LinkTransport>(connect, env, scope, links.membership->self(), replicas,
                                                      links.endpoint, timeout, links.membership.get());
  }
  if (stages > 1) {
    // A connection of its own: the link's sending threads ask it too.
    links.rosters = std::make_unique<PipelineRoster>(connect(), env.token, stages, replicas,
                                                     std::chrono::milliseconds(int64_t(comm.heartbeat_timeout * 1000)));
    const Peer self{env.rank, links.membership ? links.membership->incarnation() : 0};
    links.stage_link = std::make_unique<PeerLink>("pipeline worker", connect(), env, self, links.endpoint, timeout,
                                                  *links.rosters);
  }
  if (comm.live_status && replica_worker == 0) {
    const nlohmann::json identity = {{"rank", env.rank},
                                     {"replica", replica},
                                     {"stage", stage},
                                     {"stages", stages},
                                     {"machine", machine_name()},
                                     {"incarnation", links.membership ? links.membership->incarnation() : env.restart}};
    // A store call of its own, bounded: at the end a worker may outlive the store its status goes to.
    const auto status_store = connect_store(client, std::min<std::chrono::milliseconds>(timeout, std::chrono::seconds(10)));
    links.status = std::make_unique<StatusPublisher>(run_scope(status_store, env.token, record::kStatus), env.token, identity);
  }
  return links;
}

}  // namespace noloco
