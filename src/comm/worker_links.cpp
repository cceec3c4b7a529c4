#include "comm/worker_links.h"

namespace noloco {

WorkerLinks join_as_worker(const WorkerEnv& env, const CommConfig& comm, int stages, bool outer_method) {
  const auto timeout = std::chrono::milliseconds(int64_t(comm.peer_timeout * 1000));
  const int stage = env.rank % stages, replica = env.rank / stages, replicas = env.world / stages;
  WorkerLinks links;
  links.store = connect_store(env, timeout);  // worker 0 hosts the store when no launcher does
  auto client = env;
  client.agent_store = true;  // further connections are clients of whoever hosts it
  const auto connect = [client, timeout] { return connect_store(client, timeout); };
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
                                                  timeout);
  return links;
}

}  // namespace noloco
