// The training loop, the same for every method: the outer optimizer hooks in
// after backward and after each inner step.
#pragma once
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "config/train_config.h"
#include "train/worker_life.h"

namespace noloco {

// Runs the whole job for one worker and returns its summary (also written to
// its replica's summary file (worker_summary_path), and out/summary.json for a lone worker).
nlohmann::json train(const TrainConfig& config, const Worker& worker);

// Default run directory for a config without `out`.
std::string default_run_dir(const TrainConfig& config);
// The device a worker of `local_rank` trains on (device=cuda is its own GPU),
// refused in one line where LibTorch sees no such GPU.
std::string resolved_device(const std::string& configured, int local_rank);

}  // namespace noloco
