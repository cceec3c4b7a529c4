// Everything a worker of a launched run connects: the store, its heartbeat,
// the transport and membership among the replicas of its pipeline stage (for
// the outer method), and, pipelined, the rosters and the link to the other
// stages that the pipeline's activation channel runs over.
#pragma once
#include <memory>

#include "comm/store/etcd_server.h"
#include "comm/link/link_endpoint.h"
#include "comm/transport/gloo_transport.h"
#include "comm/transport/link_transport.h"
#include "comm/transport/peer_link.h"
#include "comm/membership/heartbeat.h"
#include "comm/membership/membership.h"
#include "comm/view/status_board.h"
#include "config/train_config.h"

namespace noloco {

struct WorkerConnections {
  // Worker 0 of a run that nobody else hosts a store for (no launcher, no
  // torchrun agent, no NOLOCO_STORE) hosts it: an etcd on bind:MASTER_PORT.
  std::unique_ptr<EtcdServer> hosted_store;
  StorePtr store;
  std::chrono::milliseconds timeout{0};  // peer_timeout: for a store call, or a peer's message
  std::unique_ptr<Heartbeat> heartbeat;
  std::shared_ptr<const Seal> seal;        // the run's payload key; null with seal=false
  // Where this worker's links to other sites start (its listening port, its
  // relays), for the transport and the pipeline's link; null inside a replica.
  std::shared_ptr<LinkEndpoint> endpoint;
  std::unique_ptr<Membership> membership;  // among the replicas of this worker's stage
  std::unique_ptr<Transport> transport;    // likewise; null for method none
  // With a pipeline: who serves each stage at a step (the pipeline's
  // liveness authority), and the link to the other stages' workers.
  std::unique_ptr<PipelineRoster> rosters;
  std::unique_ptr<PeerLink> stage_link;
  // The replica's own group, with several workers a replica; only its first
  // worker (member 0) has the membership and transport between replicas.
  std::unique_ptr<Collectives> replica_group;
  // Hosting the store: where the run's status goes, so that watchers read
  // its last entries before the store goes (outlast_store_users).
  StorePtr hosted_status;
  // The live status the replica's first worker publishes (comm.live_status);
  // last, so that it stops first, while the store is still up.
  std::unique_ptr<StatusPublisher> status;
};

// Joins the run this process was launched into as worker env.rank, laid out
// replica-major over `stages` pipeline stages, or over `replica_workers`
// workers a replica (one of the two is 1). The replica's own group runs over
// NCCL on `nccl_device` (this worker's GPU) where one is named, else Gloo.
WorkerConnections join_as_worker(const WorkerEnv& env, const CommConfig& comm, int stages, bool outer_method,
                                 int replica_workers = 1, const std::string& nccl_device = "");
// Worker 0 hosting the run's store keeps it up until the other members of
// its group have finished, died or gone silent: their last store calls (an
// exchange still in flight, their finish) need it; then until the run's
// watchers have read its last status (2 s at most). Returns at once elsewhere.
void outlast_store_users(const WorkerConnections& links);

// Whether a replica's own group runs over NCCL: in a build that has it, where
// every worker has a GPU of its own (device=cuda; NCCL takes no two members
// on one GPU), in a run that does not seal (sealing covers every byte; Gloo
// seals).
bool uses_nccl(const std::string& configured_device, const CommConfig& comm);

}  // namespace noloco
