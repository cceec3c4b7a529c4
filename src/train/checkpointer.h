// A worker's checkpoints during training: when to write them, what goes in
// them (weights, AdamW and outer state, counters), and resuming from the
// latest one. The format itself is checkpoint.h's.
#pragma once
#include <string>

#include <nlohmann/json.hpp>

#include "config/model_config.h"
#include "train/failure_drill.h"
#include "train/training_state.h"

namespace noloco {

class Checkpointer {
 public:
  // Checkpoints go to `dir` every `every` steps and at the last one, the
  // newest `keep` of them kept (0: all); `info` (seed, method, where the
  // worker sits) is stored with each; the tokenizer files are copied from `run_dir`.
  Checkpointer(std::string dir, int64_t every, int64_t keep, int64_t last_step, const ModelConfig& model,
               std::string run_dir, nlohmann::json info, const TrainingState& state, const FailureDrill& drill);
  // Loads the newest complete checkpoint into the state; returns its step, 0
  // if there is none. Throws if it is another worker's, or past the last step.
  int64_t resume();
  // After inner step `done` (1-based): writes a checkpoint if one is due.
  void after_step(int64_t done);
  const std::string& dir() const { return dir_; }

 private:
  std::string dir_;
  int64_t every_, keep_, last_step_;
  ModelConfig model_;
  std::string run_dir_;
  nlohmann::json info_;
  TrainingState state_;
  const FailureDrill& drill_;
};

}  // namespace noloco
