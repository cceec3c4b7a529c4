// The commands that start workers from this machine: `train` (one worker
// alone, a worker launched into a run with RANK set, or the launcher of a
// run's local workers, which writes the run's summary), `launch N -- PROGRAM`
// (a user's own program the torchrun way) and `bench comm`. Each returns the
// process's exit code; bad input throws std::invalid_argument in one line.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace noloco {

// Exit status of a run that finished without some of its workers (NoLoCo goes on without them).
constexpr int kFinishedWithLosses = 3;

int train_command(const std::string& config_path, const std::vector<std::string>& overrides);

// `launch N [--restarts K] [--join-dir DIR] -- PROGRAM ARGS`.
struct LaunchArgs {
  int workers = 0;
  std::vector<std::string> command;
  int64_t restarts = 0;
  std::string join_dir;
};
int launch_command(const LaunchArgs& args);

// `bench comm ...`: the launcher, or (RANK set) one of its workers.
int bench_comm_command(const std::vector<std::string>& args);

}  // namespace noloco
