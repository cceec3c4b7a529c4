// The collectives of a replica's own workers (replica_workers > 1, on one
// site's network) over c10d's ProcessGroupGloo (TCP), with the run's store
// for rendezvous. What crosses between sites goes over links instead
// (link_transport.h): Gloo cannot cross a NAT router.
#pragma once
#include <chrono>
#include <functional>
#include <memory>
#include <string>

#include "comm/transport/gloo_group.h"
#include "comm/store/store.h"
#include "comm/transport/transport.h"
#include "config/worker_env.h"

namespace noloco {

// What a group's sealed collectives bind each member's message to: the run,
// the group, the collective's number in the group (members count them
// alike), its sender and its receiver (-1: all).
struct CollectiveSeal {
  const Seal* seal = nullptr;  // null: in clear
  std::string group;
  int64_t run = 0;
  int64_t count = 0;
  std::vector<uint8_t> context(int64_t kind, int64_t number, int from, int to) const;
};

class GlooTransport final : public Collectives {
 public:
  // Member `self` of `world` in `scope` ("replica0/workers/0"). `connect`
  // opens a new connection to the run's store. The group is formed at the
  // first collective. With `seal`, every payload travels sealed
  // (comm/transport/seal.h), collectives included; null: in clear.
  GlooTransport(std::function<StorePtr()> connect, const WorkerEnv& env, std::string scope, int self, int world,
                const std::string& bind, std::chrono::milliseconds timeout, std::shared_ptr<const Seal> seal);
  ~GlooTransport() override;
  int rank() const override { return self_; }
  int world() const override { return world_; }
  void all_reduce_mean(torch::Tensor& t) override;
  void broadcast(torch::Tensor& t, int root) override;

 private:
  c10d::ProcessGroupGloo& group();

  std::function<StorePtr()> connect_;
  WorkerEnv env_;
  std::string scope_;
  int self_, world_;
  std::string bind_;
  std::chrono::milliseconds timeout_;
  std::shared_ptr<const Seal> seal_;
  CollectiveSeal sealing_;
  GlooGroup group_;  // formed at the first collective
};

}  // namespace noloco
