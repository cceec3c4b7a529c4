// A replica's training state in the one format that checkpoints and the
// hand-over to a restarted replica share: the weights (Hugging Face names),
// AdamW's moments and the outer method's state as named tensors, and the
// counters (inner steps done, the inner optimizer's steps) as JSON. A checkpoint stores them
// as model.safetensors, state.safetensors and state.json (checkpoint.h); the
// hand-over sends them as one safetensors buffer, the counters in its metadata.
#pragma once
#include <string>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "optim/flat_params.h"
#include "optim/inner_state.h"
#include "optim/outer.h"
#include "util/tensor_map.h"

namespace noloco {

struct TrainingState {
  FlatParams& params;
  InnerState& inner;  // noloco's AdamW, or a user loop's optimizer
  OuterOptimizer& outer;
};

struct StateSnapshot {
  TensorMap weights;
  TensorMap state;          // AdamW moments, outer state
  nlohmann::json counters;  // {"step": inner steps done, "adam_steps": ...}
};

StateSnapshot capture_training_state(const TrainingState& state, int64_t step);
// Restores everything and returns the snapshot's step; throws naming `source`
// and the problem (a missing weight, implausible counters, the outer
// method's complaint).
int64_t restore_training_state(const TrainingState& state, const StateSnapshot& snapshot, const std::string& source);

// The hand-over's payload: the snapshot as one safetensors buffer (uint8).
torch::Tensor serialize_training_state(const TrainingState& state, int64_t step);
int64_t deserialize_training_state(const torch::Tensor& bytes, const TrainingState& state);
// A bound on the hand-over payload a replica of this shape can send.
int64_t training_state_max_bytes(const TrainingState& state);

}  // namespace noloco
