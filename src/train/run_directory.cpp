#include "train/run_directory.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <stdexcept>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "train/checkpoint.h"
#include "util/files.h"
#include "util/run_files.h"

namespace noloco {

namespace fs = std::filesystem;

namespace {

bool holds_a_run(const fs::path& dir) {
  for (const char* f : {run_files::kConfig, run_files::kMetrics, run_files::kSummary, run_files::kCheckpoints})
    if (fs::exists(dir / f)) return true;
  return false;
}

// Resuming needs the run to be the same run: same model, method and shape.
void check_same_run(const fs::path& dir, const TrainConfig& now) {
  const auto path = (dir / run_files::kConfig).string();
  if (!fs::exists(path)) return;
  TrainConfig before;
  try {
    before = load_config(path, {});
  } catch (const std::exception& e) {
    throw std::runtime_error(fmt::format("{} cannot be read back: {}", path, e.what()));
  }
  auto differs = [&](const char* what, const std::string& a, const std::string& b) {
    if (a != b)
      throw std::invalid_argument(fmt::format("resume=true: the run in {} has {} {}, this config {} (it does not match "
                                              "the config)",
                                              dir.string(), what, a, b));
  };
  differs("model", before.model.to_json().dump(), now.model.to_json().dump());
  differs("method", choice_name(before.outer.method), choice_name(now.outer.method));
  differs("replicas", std::to_string(before.run.replicas), std::to_string(now.run.replicas));
  differs("stages", std::to_string(before.pipeline.stages), std::to_string(now.pipeline.stages));
  differs("data", before.data.path, now.data.path);
  // The subspace and the frozen part's scale define the model being trained as much as its shape does.
  const auto subspace = [](const TrainConfig& c) {
    const auto& token_std = c.pipeline.activation_subspace_token_std;
    return fmt::format("{} (frozen part's std {})", c.pipeline.activation_subspace,
                       token_std ? fmt::format("{}", *token_std) : "as initialised");
  };
  differs("activation_subspace", subspace(before), subspace(now));
  // A run resumes forwards: a checkpoint past `steps` would make every worker
  // refuse it after the run directory had been rewritten.
  std::error_code ec;
  for (const auto& worker : fs::directory_iterator(dir / run_files::kCheckpoints, ec)) {
    const auto steps = complete_checkpoint_steps(worker.path().string());
    if (!steps.empty() && steps.back() > now.inner.steps)
      throw std::invalid_argument(fmt::format(
          "resume=true: {} holds a checkpoint of step {}, past steps={} (a run resumes to the same or a later step)",
          worker.path().string(), steps.back(), now.inner.steps));
  }
}

// Who holds a run's lock, as its file says: a launcher writes its pid; the
// workers of a run started without one write nothing.
std::string lock_owner(const std::string& lock) {
  try {
    const auto pid = read_file(lock);
    if (!pid.empty()) return "pid " + pid;
  } catch (const std::exception&) {
  }
  return "workers started without noloco's launcher";
}

}  // namespace

RunDirectory::RunDirectory(const std::string& path, const TrainConfig& config, Hold hold) : path_(path) {
  const fs::path dir(path);
  if (fs::exists(dir) && !fs::is_directory(dir))
    throw std::invalid_argument(fmt::format("out={} is not a directory", path));
  if (hold == Hold::worker) {
    shared_ = true;
    // The lock file stays: removed while another worker holds it, a later run would lock a new one.
    fs::create_directories(dir);
    const auto lock = (dir / run_files::kLock).string();
    lock_fd_ = ::open(lock.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (lock_fd_ < 0) throw std::runtime_error(fmt::format("cannot open {}: {}", lock, std::strerror(errno)));
    if (::flock(lock_fd_, LOCK_SH | LOCK_NB) != 0) {
      ::close(lock_fd_);
      lock_fd_ = -1;
      throw std::runtime_error(fmt::format("out={} is in use by another run ({}), started by noloco's launcher", path,
                                           lock_owner(lock)));
    }
    return;
  }
  if (config.run.resume && !holds_a_run(dir))
    throw std::invalid_argument(fmt::format("resume=true: out={} holds no run to continue (no config.yaml, metrics or "
                                            "checkpoints): check out=, or leave resume out to start a new run",
                                            path));
  created_directory_ = !fs::exists(dir);
  fs::create_directories(dir);
  const auto lock = (dir / run_files::kLock).string();
  created_lock_ = !fs::exists(lock);
  lock_fd_ = ::open(lock.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (lock_fd_ < 0) throw std::runtime_error(fmt::format("cannot open {}: {}", lock, std::strerror(errno)));
  if (::flock(lock_fd_, LOCK_EX | LOCK_NB) != 0) {
    ::close(lock_fd_);
    lock_fd_ = -1;
    throw std::runtime_error(fmt::format("out={} is in use by another run ({})", path, lock_owner(lock)));
  }
  const auto pid = std::to_string(::getpid());
  if (::ftruncate(lock_fd_, 0) != 0 || ::pwrite(lock_fd_, pid.data(), pid.size(), 0) != ssize_t(pid.size())) {
    // the pid is only for the message above; the lock is what protects
  }
  try {
    if (!config.run.resume && holds_a_run(dir))
      throw std::invalid_argument(fmt::format("out={} already holds a run; continue it with resume=true or choose "
                                              "another out (a new run never overwrites one)",
                                              path));
    if (config.run.resume) check_same_run(dir, config);
  } catch (...) {
    remove_if_unused();
    throw;
  }
}

RunDirectory::~RunDirectory() { remove_if_unused(); }

void RunDirectory::remove_if_unused() {
  const fs::path dir(path_);
  std::error_code ec;
  // Unlinked while still locked, so no other run can have taken it meanwhile.
  if (created_lock_ && !holds_a_run(dir)) fs::remove(dir / run_files::kLock, ec);
  if (lock_fd_ >= 0 && !shared_ && ::ftruncate(lock_fd_, 0) != 0) {
    // a stale pid only misnames the holder in a refusal's message
  }
  if (lock_fd_ >= 0) ::close(lock_fd_);  // closing releases the lock
  lock_fd_ = -1;
  if (created_directory_) fs::remove(dir, ec);  // only while empty
}

}  // namespace noloco
