// A replica of several workers (replica_workers=K), torchft's HSDP shape: the
// K workers average their gradients every inner step over the replica's own
// group, so the replica steps as one with K times the batch, and the outer
// method between replicas runs on the replica's first worker only. That
// worker sends what a one-worker replica sends (the node's uplink carries it
// once) and keeps the outer state (one checkpoint per replica); after each
// outer step it hands the weights it produced to the others over the
// replica's group, which is the fast one (a node's links). Under pace=speed
// the first worker's pace decides for the replica which slots it trains.
#pragma once
#include <memory>

#include "optim/outer.h"

namespace noloco {

class ReplicaOfWorkers final : public OuterOptimizer {
 public:
  // `replica`: the replica's group (its member 0 leads); `between`: the outer
  // method on the leader, a method-less OuterOptimizer on the others;
  // `paced`: pace=speed.
  ReplicaOfWorkers(Collectives& replica, std::unique_ptr<OuterOptimizer> between, bool paced);
  bool on_gradients(FlatParams& params) override;
  std::optional<OuterSync> after_inner_step(int64_t step, FlatParams& params) override;
  std::vector<OuterSync> finish(FlatParams& params) override;
  void save(TensorMap& out) const override { between_->save(out); }
  void load(const TensorMap& in) override { between_->load(in); }
  // The leader's (its others have none: their figures are the leader's).
  Pace* pace() override { return between_->pace(); }
  // The leader's pace answers for the whole replica: its workers skip a
  // slot together, or the others would wait in the gradients' all-reduce.
  bool trains_at(int64_t step) override;

 private:
  // The leader says whether its outer method changed the weights; if so, they go to the others.
  void share_weights(FlatParams& params, bool changed);

  Collectives& replica_;
  std::unique_ptr<OuterOptimizer> between_;
  const bool paced_;
};

}  // namespace noloco
