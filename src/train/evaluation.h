// Evaluations across replicas (the paper's Fig. 3B): the spread of weights
// across the live replicas, and the validation loss of their average. They
// form a group of the replicas alive at that step (an agreed snapshot), so
// they survive deaths and rejoins; their traffic is not training traffic.
// With many replicas the group is a sample of them (eval.spread_replicas):
// a group of all would need every replica at once, and a link between each
// two of them.
#pragma once
#include <cmath>
#include <functional>
#include <vector>

#include "comm/membership/membership.h"
#include "comm/transport/transport.h"
#include "optim/flat_params.h"
#include "pipeline/worker_model.h"

namespace noloco {

struct ReplicaSpread {
  double mean_model_loss = std::nan("");  // on the first live replica only
  double weight_std = std::nan("");
  uint64_t bytes_sent = 0;
  // The figures are of `replicas` of the `live_replicas` alive at that step
  // (0 of them: this replica was not in the sample, or none formed).
  int replicas = 0, live_replicas = 0;
};

// The replicas whose weights make the figures of evaluation `step`, sorted:
// all of `members` (sorted) when they are at most `k` or `k` is 0; else the
// first (it evaluates the mean model, in a pipeline along its own stages)
// and k−1 of the others drawn by (seed, step), the same on every member.
std::vector<Peer> spread_sample(uint64_t seed, int64_t step, const std::vector<Peer>& members, int64_t k);

// After inner step `step`; `model` holds `flat`'s weights. `seed`, `k`: the
// run's seed and eval.spread_replicas. Without `validates` (a run with no
// validation data) only the spread is measured.
ReplicaSpread evaluate_across_replicas(int64_t step, uint64_t seed, int64_t k, Transport& transport,
                                       Membership& membership, FlatParams& flat, WorkerModel& model, bool validates);

}  // namespace noloco
