// A replica's whole training state as one byte buffer, so that a live
// replica can hand it to a restarted one over the network (rejoin): the step
// and AdamW's step counter, then fp32 weights, AdamW first and second
// moments, and the outer method's state. The layout follows the parameter
// order, so both sides agree without a manifest.
#pragma once
#include <torch/torch.h>

#include "optim/flat_params.h"
#include "optim/inner.h"
#include "optim/outer.h"

namespace noloco {

struct TrainingState {
  FlatParams& params;
  InnerOptimizer& inner;
  OuterOptimizer& outer;
};

int64_t training_state_bytes(const TrainingState& state);
// `step`: inner steps done.
torch::Tensor pack_training_state(const TrainingState& state, int64_t step);
// Restores everything and returns the step it was packed at.
int64_t unpack_training_state(const torch::Tensor& bytes, const TrainingState& state);

}  // namespace noloco
