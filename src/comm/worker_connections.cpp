#include "comm/worker_connections.h"

#include <algorithm>

#include <fmt/format.h>

#include "comm/run_keys.h"
#include "comm/seal.h"

namespace noloco {

namespace {

// Plain HTTP that never leaves the machine: every endpoint (a cluster's,
// comma-separated) on loopback.
bool in_clear_off_machine(const std::string& urls) {
  for (size_t start = 0; start < urls.size();) {
    const size_t comma = std::min(urls.find(',', start), urls.size());
    const auto url = urls.substr(start, comma - start);
    start = comma + 1;
    if (url.rfind("http://", 0) != 0) continue;
    const auto host = url.substr(7);
    if (host.rfind("127.", 0) != 0 && host.rfind("localhost", 0) != 0 && host.rfind("[::1]", 0) != 0) return true;
  }
  return false;
}

}  // namespace

WorkerConnections join_as_worker(const WorkerEnv& env, const CommConfig& comm, int stages, bool outer_method,
                                 const ActivationCodecs& codecs) {
  const auto timeout = std::chrono::milliseconds(int64_t(comm.peer_timeout * 1000));
  const int stage = env.rank % stages, replica = env.rank / stages, replicas = env.world / stages;
  WorkerConnections links;
  links.timeout = timeout;
  auto client = env;
  if (env.store_url.empty() && !env.agent_store) {
    // The store crosses the network: over TLS, every worker pinning the key
    // that the token gives (comm/run_keys.h), unless sealing is off.
    const auto tls = store_tls_key(env.token);
    if (comm.seal) client.store_pin = tls.pin;
    if (env.rank == 0) {
      links.hosted_store =
          std::make_unique<EtcdServer>(comm.bind, env.master_port, store_password(env.token), comm.seal ? &tls : nullptr);
      client.store_url = links.hosted_store->endpoint();
    } else {
      client.store_url = fmt::format("{}://{}:{}", comm.seal ? "https" : "http", env.master_addr, env.master_port);
    }
  } else if (comm.seal && in_clear_off_machine(client.store_url)) {
    throw std::runtime_error(fmt::format(
        "NOLOCO_STORE={}: the store's traffic would cross the network in clear; use https:// with NOLOCO_STORE_CA "
        "(README, Several machines), or seal=false",
        client.store_url));
  }
  const auto connect = [client, timeout] { return connect_store(client, timeout); };
  links.store = connect();
  links.heartbeat = std::make_unique<Heartbeat>(connect(), env.token, env.rank);
  if (comm.seal) links.seal = std::make_shared<const Seal>(env.token);
  if (outer_method) {
    const auto scope = replica_scope(stages, stage);
    links.membership = std::make_unique<Membership>(connect(), env, scope, replica, replicas,
                                                    std::chrono::milliseconds(int64_t(comm.heartbeat_timeout * 1000)),
                                                    timeout, links.heartbeat.get());
    links.transport = std::make_unique<GlooTransport>(connect, env, scope, links.membership->self(), replicas,
                                                      comm.bind, timeout, links.seal);
  }
  if (stages > 1)
    links.link = std::make_unique<ActivationLink>(links.store, env, stages,
                                                  links.membership ? links.membership->incarnation() : 0, comm.bind,
                                                  timeout, links.seal, codecs);
  return links;
}

}  // namespace noloco
