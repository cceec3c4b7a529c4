// A worker's checkpoints during training: when to write them, what goes in
// them (weights, AdamW and outer state, counters), and resuming from the
// latest one. The format itself is checkpoint.h's.
#pragma once
#include <string>
#include <vector>

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
  // The steps of this worker's complete checkpoints, oldest first.
  std::vector<int64_t> complete_steps() const;
  // Loads the checkpoint of `step` (0: none, start afresh) into the state.
  // Step directories after it (a run resumed at an older step that all its
  // workers hold) are renamed aside to `<name>.superseded`, never
  // deleted. Throws if it is another worker's, or past the last step.
  void resume_at(int64_t step);
  // After inner step `done` (1-based): writes a checkpoint if one is due.
  void after_step(int64_t done);
  // Writes the checkpoint of step `done` now (a replica leaving the run).
  void save(int64_t done);
  const std::string& dir() const { return dir_; }
  // This worker reads another's checkpoints (a replica's first worker writes
  // them for all its workers, whose states are the same): it resumes from
  // them and never writes or renames.
  void follow() { writes_ = false; }

 private:
  std::string dir_;
  int64_t every_, keep_, last_step_;
  ModelConfig model_;
  std::string run_dir_;
  nlohmann::json info_;
  TrainingState state_;
  const FailureDrill& drill_;
  bool writes_ = true;
};

}  // namespace noloco
