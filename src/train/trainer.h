// The training loop, the same for every method: the outer optimizer hooks in
// after backward and after each inner step.
#pragma once
#include <string>

#include <nlohmann/json.hpp>

#include "comm/communicator.h"
#include "train/config.h"

namespace noloco {

struct WorkerInfo {
  int rank = 0;
  int world = 1;
  int local_world = 1;           // workers sharing this machine's cores
  Communicator* comm = nullptr;  // null for a single replica without a method
  bool verbose = true;           // print progress and samples
};

// Runs the whole job for one replica and returns its summary (also written to
// out/summary_r<rank>.json, and out/summary.json when world == 1).
nlohmann::json train(const TrainConfig& config, const WorkerInfo& worker);

// Default run directory for a config without `out`.
std::string default_run_dir(const TrainConfig& config);

}  // namespace noloco
