// Checkpoints: a directory per step holding model.safetensors (Hugging Face
// parameter names), state.safetensors (Adam moments, outer state), state.json
// (step and counters), the tokenizer, and checksums.json (CRC-32C of every
// other file, checked on every load). Written under a temporary name and
// renamed, then `latest` is switched atomically: a crash at any point leaves
// the previous checkpoint intact and findable. A directory step_<N> with
// checksums.json is complete; the newest complete one is the one resumed.
#pragma once
#include <functional>
#include <map>
#include <string>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "config/model_config.h"
#include "optim/inner.h"
#include "util/tensor_file.h"

namespace noloco {

struct Checkpoint {
  ModelConfig model;
  TensorMap weights;  // Hugging Face names
  TensorMap state;    // optimizer and outer-method state
  nlohmann::json info;  // step, tokens, ...
};

// Writes `dir/step_<step>` and points `dir/latest` at it; returns its path.
// Never overwrites a checkpoint: throws if step_<step> exists. Keeps the
// newest `keep` complete checkpoints of `dir` (0: all). `halfway` (failure
// drills) runs after the first file of the new checkpoint is written.
std::string write_checkpoint(const std::string& dir, int64_t step, const Checkpoint& ckpt,
                             const std::string& tokenizer_dir, const std::function<void()>& halfway = {},
                             int64_t keep = 0);
// `path` is a checkpoint directory (model.safetensors with state.json or
// checksums.json: a Hugging Face directory is none), a directory of
// checkpoints (its newest complete one), or a run directory (its
// checkpoints/r0). Empty string if it holds none; throws if it holds step
// directories of which none is complete.
std::string find_checkpoint(const std::string& path);
// The step_<N> directories of a directory of checkpoints, oldest first;
// complete ones hold checksums.json (written last). step_<N>.tmp (a write
// that never finished) is none.
struct StepDirectory {
  int64_t step;
  std::string path;
  bool complete;
};
std::vector<StepDirectory> step_directories(const std::string& dir);
// The steps of the complete checkpoints in a directory of checkpoints, oldest first.
std::vector<int64_t> complete_checkpoint_steps(const std::string& dir);
// The checkpoint of `step` in a directory of checkpoints.
std::string checkpoint_path(const std::string& dir, int64_t step);
// Loads and checks a checkpoint: every file against its checksum, state.json's
// fields, and weights that match the model config exactly (a pipeline
// stage's: its slice of the model, with the whole model's names). Throws
// std::runtime_error naming the file and the problem.
Checkpoint read_checkpoint(const std::string& checkpoint_dir, bool with_state);
// The whole model of a checkpoint: a pipeline stage's is joined with the
// other stages of its replica at the same step.
Checkpoint read_whole_model(const std::string& checkpoint_dir);

}  // namespace noloco
