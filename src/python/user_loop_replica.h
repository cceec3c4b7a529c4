// One replica of a run whose model and training loop are the user's (the
// Python module's OuterOptimizer): the outer method and its network, the same
// objects the CLI's workers use, driven by one call after each inner step of
// the user's own optimizer. The process is a worker launched the torchrun way
// (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, NOLOCO_RUN_TOKEN), or one that
// joins a running NoLoCo run: one replica of one worker, no pipeline.
#pragma once
#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "comm/store/run_record.h"
#include "config/train_config.h"
#include "config/worker_env.h"
#include "optim/flat_params.h"
#include "optim/outer.h"
#include "optim/inner_state.h"
#include "train/failure_drill.h"
#include "train/rejoin.h"
#include "train/worker_life.h"
#include "util/tensor_map.h"

namespace noloco {

// What an outer step did, as the user's loop sees it.
struct UserOuterStep {
  OuterSync sync;
  std::vector<int> lost;  // of its group, the replicas whose message did not come (dead, silent or rejected)
  std::vector<int> handed_over_to;  // restarted or joining replicas given this replica's state after it
};

// How the process comes into the run.
struct UserLoopStart {
  // A c10d TCPStore already serves MASTER_ADDR:MASTER_PORT (the user's
  // torch.distributed, initialised from the environment): the run's store is
  // that one, rather than an etcd worker 0 would host there.
  bool store_at_master = false;
  // Joins a running NoLoCo run as a new replica: from the environment
  // (joiner_env_from_environment) when join_dir is empty, else from the
  // invitation `noloco launch --join-dir` writes there.
  bool join = false;
  std::string join_dir;
};

class UserLoopReplica {
 public:
  // `params` are re-seated into one flat buffer (the caller's tensors become
  // views of it); `keys` are the CLI's "key=value" settings, only those of
  // outer_method_keys(). `inner` is the user's optimizer's state, handed to
  // and taken from restarted and joining replicas with the weights (null: a
  // replica that takes a live one's state starts its optimizer afresh).
  // Joins the run; a restarted or joining replica then waits for a live one's
  // state (rejoined() says whose, at which step). Throws std::invalid_argument
  // naming a bad key or environment, std::runtime_error when the run cannot
  // be reached.
  UserLoopReplica(std::vector<std::pair<std::string, torch::Tensor>> params, const std::vector<std::string>& keys,
                  const UserLoopStart& start = {}, std::unique_ptr<InnerState> inner = nullptr);
  // Ends the membership as finish() does, if the loop did not.
  ~UserLoopReplica();
  UserLoopReplica(const UserLoopReplica&) = delete;
  UserLoopReplica& operator=(const UserLoopReplica&) = delete;

  // pace=speed: whether this replica trains in the coming slot, asked once
  // before each step() (again: the same answer). A replica slower than the
  // fastest trains in only its share of each period's slots and calls step()
  // after the others too, so that all reach each outer step together
  // (optim/pace.h). Its step time is measured from this call to step().
  // Always true under pace=steps.
  bool trains_now();
  // After each inner step (or slot left out, under pace=speed): the outer
  // step when one is due, then the state handed to replicas that asked for it. A lost peer is in `lost`, never an
  // exception. After a SIGTERM (NoLoCo) it leaves the run instead: what is in
  // flight is applied and the partners are told.
  std::vector<UserOuterStep> step();
  // After the last inner step: what is still in flight is applied; the
  // membership ends (the partners stop waiting for this replica). Idempotent.
  std::vector<UserOuterStep> finish();
  // Leaves before the end of the run (NoLoCo): as finish(), and the others are
  // told not to wait for this replica.
  std::vector<UserOuterStep> leave();

  // The user's losses at the current inner step, for the run's live page
  // (comm/view/): a training loss for the table, a validation loss as a
  // point of the replica's curve. NaN: not given.
  void report(double loss, double val_loss);
  // Outer state (slow weights, momentum, residuals) and the inner-step count.
  TensorMap state() const;
  void load_state(const TensorMap& state);

  const TrainConfig& config() const { return config_; }
  int replica() const { return worker_.rank(); }
  int replicas() const { return worker_.env.world; }
  int64_t params() const { return flat_.numel(); }
  int64_t inner_steps() const { return inner_steps_; }
  int64_t outer_steps() const { return outer_steps_; }
  // Set for a restarted or joining replica: the live replica whose state it took.
  const std::optional<Rejoined>& rejoined() const { return rejoined_; }
  // Bytes this replica's outer steps sent (message headers included), since this process began.
  uint64_t outer_bytes() const { return outer_bytes_; }
  // Everything the transport sent and received (also evaluations, hand-overs).
  CommStats traffic() const;
  double bits_per_param_per_inner_step() const;
  bool left() const { return left_; }
  bool finished() const { return finished_; }

 private:
  std::vector<UserOuterStep> reported(std::vector<OuterSync> syncs);
  // Hands the live status a record of this replica's, as the CLI's workers' telemetry does.
  void publish(const char* split, nlohmann::json fields) const;
  void end_status(record::WorkerState state) const;

  TrainConfig config_;
  Worker worker_;
  FlatParams flat_;
  std::unique_ptr<InnerState> inner_;
  std::unique_ptr<OuterOptimizer> outer_;
  FailureDrill drill_;
  WorkerLife life_;
  std::optional<Rejoined> rejoined_;
  int64_t inner_steps_ = 0, outer_steps_ = 0;
  // pace=speed: the slot trains_now() answered for, its answer and when.
  std::optional<int64_t> asked_for_;
  bool trains_ = true;
  std::chrono::steady_clock::time_point asked_at_;
  int64_t first_step_ = 0;  // where this process began: 0, or a loaded state's step
  uint64_t outer_bytes_ = 0;
  bool left_ = false, finished_ = false;
};

}  // namespace noloco
