// The training loop, the same for every method: the outer optimizer hooks in
// after backward and after each inner step.
#pragma once
#include <functional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "comm/transport/activation_link.h"
#include "comm/membership/membership.h"
#include "comm/transport/transport.h"
#include "config/train_config.h"

namespace noloco {

struct WorkerInfo {
  int rank = 0;  // worker: replica * stages + stage
  int replica = 0, replicas = 1;
  int stage = 0, stages = 1;
  int local_rank = 0;   // this worker among them: device=cuda is its own GPU
  int local_world = 1;  // workers sharing this machine's cores
  // A replica of several workers (replica_workers): this worker's place in
  // it, and the replica's own group (null for a one-worker replica). Its
  // first worker holds the transport and membership between replicas and
  // speaks for the replica (metrics, evaluations, checkpoints, summary figures).
  int replica_worker = 0, replica_workers = 1;
  Transport* replica_group = nullptr;
  // It starts from a live replica's state, not step 0 or the disk:
  // restarted by its launcher after a failure, or joining the running run.
  // Its replica's first worker takes the state and hands it on.
  bool from_live_state = false;
  // Among the replicas of this worker's stage; null for a lone replica without a method.
  Transport* transport = nullptr;
  Membership* membership = nullptr;
  ActivationLink* link = nullptr;  // to the other stages; null without a pipeline
  // With resume=true: given this worker's complete checkpoint steps, the step
  // the whole run resumes from (agreed with the other workers). Unset: a lone
  // worker, which takes its newest.
  std::function<int64_t(const std::vector<int64_t>&)> agree_resume_step;
  bool verbose = true;             // print progress and samples
  // Asked after every step: true once this worker is to leave the run
  // (SIGTERM to a NoLoCo worker). Unset: it never leaves before the end.
  std::function<bool()> leave_requested;
};

// Runs the whole job for one worker and returns its summary (also written to
// out/summary_r<rank>.json, and out/summary.json for a lone worker).
nlohmann::json train(const TrainConfig& config, const WorkerInfo& worker);

// Default run directory for a config without `out`.
std::string default_run_dir(const TrainConfig& config);
// The device a worker of `local_rank` trains on (device=cuda is its own GPU),
// refused in one line where LibTorch sees no such GPU.
std::string resolved_device(const std::string& configured, int local_rank);

}  // namespace noloco
