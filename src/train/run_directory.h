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
  // Creates `path` if needed, checks it and takes the lock; throws
  // std::invalid_argument / std::runtime_error with the reason.
  RunDirectory(const std::string& path, const TrainConfig& config);
  ~RunDirectory();
  RunDirectory(const RunDirectory&) = delete;
  RunDirectory& operator=(const RunDirectory&) = delete;

 private:
  // Removes what the constructor created while the directory holds no run.
  void remove_if_unused();

  std::string path_;
  bool created_directory_ = false, created_lock_ = false;
  int lock_fd_ = -1;
};

}  // namespace noloco
