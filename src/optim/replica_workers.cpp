#include "optim/replica_workers.h"

namespace noloco {

ReplicaOfWorkers::ReplicaOfWorkers(Collectives& replica, std::unique_ptr<OuterOptimizer> between, bool paced)
    : replica_(replica), between_(std::move(between)), paced_(paced) {}

bool ReplicaOfWorkers::trains_at(int64_t step) {
  if (!paced_) return true;
  auto flag = torch::full({1}, replica_.rank() == 0 && between_->trains_at(step) ? 1.0f : 0.0f);
  replica_.broadcast(flag, 0);
  return flag.item<float>() != 0;
}

bool ReplicaOfWorkers::on_gradients(FlatParams& params) {
  replica_.all_reduce_mean(params.grads());
  return between_->on_gradients(params);
}

std::optional<OuterSync> ReplicaOfWorkers::after_inner_step(int64_t step, FlatParams& params) {
  auto sync = between_->after_inner_step(step, params);
  share_weights(params, sync.has_value());
  return sync;
}

std::vector<OuterSync> ReplicaOfWorkers::finish(FlatParams& params) {
  auto syncs = between_->finish(params);
  share_weights(params, !syncs.empty());
  return syncs;
}

void ReplicaOfWorkers::share_weights(FlatParams& params, bool changed) {
  // One value a step: the others cannot tell an outer step's end (overlap
  // delays it; a lost partner skips it), so the leader says.
  auto flag = torch::full({1}, changed ? 1.0f : 0.0f);
  replica_.broadcast(flag, 0);
  if (flag.item<float>() != 0) replica_.broadcast(params.values(), 0);
}

}  // namespace noloco
