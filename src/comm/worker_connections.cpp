#include "comm/worker_connections.h"

#include <fmt/format.h>

namespace noloco {

WorkerConnections join_as_worker(const WorkerEnv& env, const CommConfig& comm, int stages, bool outer_method,
                                 const ActivationCodecs& codecs) {
  const auto timeout = std::chrono::milliseconds(int64_t(comm.peer_timeout * 1000));
  const int stage = env.rank % stages, replica = env.rank / stages, replicas = env.world / stages;
  WorkerConnections links;
  links.timeout = timeout;
  auto client = env;
  if (env.store_url.empty() && !env.agent_store) {
    if (env.rank == 0) {
      links.hosted_store = std::make_unique<EtcdServer>(comm.bind, env.master_port, env.token);
      client.store_url = links.hosted_store->endpoint();
    } else {
      client.store_url = fmt::format("http://{}:{}", env.master_addr, env.master_port);
    }
  }
  const auto connect = [client, timeout] { return connect_store(client, timeout); };
  links.store = connect();
  links.heartbeat = std::make_unique<Heartbeat>(connect(), env.token, env.rank);
  if (outer_method) {
    const auto scope = replica_scope(stages, stage);
    links.membership = std::make_unique<Membership>(connect(), env, scope, replica, replicas,
                                                    std::chrono::milliseconds(int64_t(comm.heartbeat_timeout * 1000)));
    links.transport = std::make_unique<GlooTransport>(connect, env, scope, links.membership->self(), replicas,
                                                      comm.bind, timeout);
  }
  if (stages > 1)
    links.link = std::make_unique<ActivationLink>(links.store, env, stages,
                                                  links.membership ? links.membership->incarnation() : 0, comm.bind,
                                                  timeout, codecs);
  return links;
}

}  // namespace noloco
