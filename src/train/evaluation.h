// Evaluations across replicas (the paper's Fig. 3B): the spread of weights
// across the live replicas, and the validation loss of their average. They
// form a group of the replicas alive at that step (an agreed snapshot), so
// they survive deaths and rejoins; their traffic is not training traffic.
#pragma once
#include <cmath>
#include <functional>

#include "comm/membership/membership.h"
#include "comm/transport/transport.h"
#include "optim/flat_params.h"
#include "pipeline/worker_model.h"

namespace noloco {

struct ReplicaSpread {
  double mean_model_loss = std::nan("");  // on the first live replica only
  double weight_std = std::nan("");
  uint64_t bytes_sent = 0;
};

// After inner step `step`; `model` holds `flat`'s weights.
ReplicaSpread evaluate_across_replicas(int64_t step, Transport& transport, Membership& membership, FlatParams& flat,
                                       WorkerModel& model);

}  // namespace noloco
