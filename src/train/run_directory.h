// A run directory belongs to one run. While a run uses it, it holds an
// exclusive lock (run.lock, with the owner's pid); a second run started on it
// is refused. A directory that already holds a run (its config, metrics,
// summaries or checkpoints) is never taken over by a new one: only
// resume=true continues it, and only with the same model, method and shape;
// resume=true on a directory that holds no run is refused (a mistyped out=
// would otherwise start a new run). A start that fails before the run wrote
// anything leaves no directory or lock file behind.
#pragma once
#include <string>

#include "config/train_config.h"

namespace noloco {

class RunDirectory {
 public:
  // run: the launcher's hold on its run's directory, exclusive, with the
  // checks above. worker: a worker of a run started without the launcher
  // (plain env, torchrun), sharing the lock with the run's other workers on
  // this machine: a launched run is refused in their directory, and they in
  // a launched run's.
  enum class Hold { run, worker };
  // Creates `path` if needed, checks it and takes the lock; throws
  // std::invalid_argument / std::runtime_error with the reason.
  RunDirectory(const std::string& path, const TrainConfig& config, Hold hold = Hold::run);
  ~RunDirectory();
  RunDirectory(const RunDirectory&) = delete;
  RunDirectory& operator=(const RunDirectory&) = delete;

 private:
  // Removes what the constructor created while the directory holds no run.
  void remove_if_unused();

  std::string path_;
  bool created_directory_ = false, created_lock_ = false;
  bool shared_ = false;  // Hold::worker
  int lock_fd_ = -1;
};

}  // namespace noloco
