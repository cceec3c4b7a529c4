// One home for a worker's life in a run, whichever way the process came in
// (the CLI's launched workers, `noloco join`, the Python door's replicas):
// its start-up (start_worker: the start-up drill, the run's groups) and what
// happens around each of its inner steps (WorkerLife: the outer step, the
// state handed to restarted and joining workers, leaving on SIGTERM from the
// first step on, the end). The training loops (train/trainer.cpp, the
// Python module's UserLoopReplica) call these and nothing below them.
#pragma once
#include <algorithm>
#include <chrono>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "comm/launch/worker_connections.h"
#include "config/run_layout.h"
#include "config/train_config.h"
#include "config/worker_env.h"
#include "optim/flat_params.h"
#include "optim/outer.h"
#include "train/failure_drill.h"
#include "train/rejoin.h"
#include "train/training_state.h"
#include "train/worker_states.h"

namespace noloco {

// How a process comes into the run. The rest of its place (stages, workers
// a replica, the outer method, the device of a replica's NCCL group) is the
// config's.
struct WorkerStart {
  WorkerEnv env;
  // A joiner: it starts from a live replica's state, never from the disk,
  // and has passed its start-up drill whatever its restart count says.
  bool joins = false;
  std::string log_name = "worker";  // its log lines say "noloco[<log_name> <rank>]"
  // A model the config does not describe (the Python door's: the user's
  // module), as a line every worker of the run must agree on.
  std::string user_model;
};

// A worker of the run, whichever way it came in (start_worker makes every
// one; a default one is a lone worker with no network): how it came in, its
// connections and its place in the run, each held once.
struct Worker {
  WorkerEnv env;            // its rank, and the workers sharing this machine's cores
  WorkerConnections links;  // none for a world of one without an outer method
  int replica = 0, replicas = 1;
  int stage = 0, stages = 1;
  // A replica of several workers (replica_workers): this worker's place in
  // it. Its first worker holds the transport and membership between replicas
  // and speaks for the replica (metrics, evaluations, checkpoints, summary figures).
  int replica_worker = 0, replica_workers = 1;
  // It starts from a live replica's state, not step 0 or the disk:
  // restarted by its launcher after a failure, or joining the running run.
  // Its replica's first worker takes the state and hands it on.
  bool from_live_state = false;
  // With resume=true: given this worker's complete checkpoint steps, the step
  // the whole run resumes from (agreed with the other workers). Unset: a lone
  // worker, which takes its newest.
  std::function<int64_t(const std::vector<int64_t>&)> agree_resume_step;
  bool verbose = true;  // print progress and samples
  // Its output is a terminal of its own (not our launcher's, which prints
  // one replica's progress for all): a machine's first worker of a run of
  // several machines, or a joiner. Its replica's speaker prints its own progress.
  bool own_console = false;
  // Asked after every step: true once this worker is to leave the run
  // (SIGTERM to a NoLoCo worker). Unset: it never leaves before the end.
  std::function<bool()> leave_requested;

  int rank() const { return env.rank; }  // its place in layout()
  RunLayout layout() const { return RunLayout(stages, replica_workers, std::max(1, replicas)); }
  // Among the replicas of this worker's stage; null for a lone replica without a method.
  Transport* transport() const { return links.transport.get(); }
  Membership* membership() const { return links.membership.get(); }
  // To the other stages, with a pipeline (null without): its rosters and link.
  PipelineRoster* rosters() const { return links.rosters.get(); }
  PeerLink* stage_link() const { return links.stage_link.get(); }
  // The replica's own group (null for a one-worker replica).
  Collectives* replica_group() const { return links.replica_group.get(); }
  // Where the replica's first worker publishes its live status (null: nowhere; comm/view/status_board.h).
  StatusPublisher* status() const { return links.status.get(); }
};

// Whether SIGTERM asks a worker of this run to leave it (NoLoCo's replicas of
// one worker) rather than to stop.
bool leaves_on_sigterm(const TrainConfig& config, int stages);

// The one way a process becomes a worker. Start-up: the start-up drill (a
// first start only; a restarted worker is past it), SIGTERM as a request to
// leave where the run allows it, then the run's store and groups; a world of
// one without an outer method (a lone worker) has none. A worker hosting the
// run's store keeps it up, at the end, until the others are done with it
// (finish_worker). Refused in one line naming every key that differs when the
// run's other workers were started with another config (config.run_yaml()).
Worker start_worker(const TrainConfig& config, const WorkerStart& start);
// The run's config (run_yaml) as its first worker published it in `store`; empty if none has yet.
std::string published_run_config(const StorePtr& store, const std::string& token);
void finish_worker(const Worker& worker);

// What happened after one inner step, and what the worker does next.
struct AfterStep {
  LifeAction next = LifeAction::train_on;  // renew is done already (`renewed`)
  StoreNews store = StoreNews::none;       // to say: the store went silent, or answers again
  std::vector<OuterSync> syncs;  // the outer steps it took (several at the end, with overlap)
  HandOvers handovers;           // the restarted or joining workers given this worker's state
  double blocked_seconds = 0;    // how long the outer step held up training
  // A partner refused this replica's message as diverged: it took a live
  // replica's state and goes on from its step.
  std::optional<Rejoined> renewed;
};

// A worker's life around its inner steps: the same for every loop. What it
// does next is its WorkerStates' answer (train/worker_states.h); this class
// gathers the facts and carries the answer out. It holds references only;
// the loop owns the weights, the optimizers and the drill.
class WorkerLife {
 public:
  // `store_outage`: how long the store may stay silent before the worker
  // ends with its checkpoint (unset: it trains on alone).
  WorkerLife(const TrainConfig& config, const Worker& worker, FlatParams& flat, OuterOptimizer& outer,
             const TrainingState& state, const FailureDrill& drill, std::optional<double> store_outage);

  // Whether this worker starts from a live replica's state: restarted, or joining.
  bool takes_live_state() const;
  // At start: a restarted or joining worker waits for a live replica's state
  // at that replica's next outer step and takes it (refused in one line for
  // a run that cannot take workers back); any other starts as it is (nullopt).
  std::optional<Rejoined> start();
  // Before inner step `step` (0-based): from now on SIGTERM asks a worker
  // that can leave to; the failure drill's kill, freeze, stall or
  // corruption, if one is due.
  void before_step(int64_t step) const;
  // After inner step `done` (1-based): the outer step, if one is due (the last
  // step also applies what is still in flight), then what the worker does
  // next: a replica a partner refused as diverged takes a live replica's
  // state here; otherwise the state is handed to the workers that asked for
  // it (not after the last: they would only join the end late).
  AfterStep after_inner_step(int64_t done, bool last);
  // Leaves before the end: what is in flight is applied, the partners are
  // told not to wait for this worker.
  std::vector<OuterSync> leave();
  // At the end (after the worker's own last records): the partners stop
  // waiting for it. `summary`: its replica's summary (empty: none), kept in
  // the run's store for the worker writing the run's (train/run_end.h).
  void end_membership(const std::string& summary) const;

 private:
  // After an outer step a partner refused as diverged: drops what is in
  // flight and takes a live replica's state, as a restarted replica does.
  Rejoined renew(int64_t outer_step, int64_t step);

  const TrainConfig& config_;
  const Worker& worker_;
  FlatParams& flat_;
  OuterOptimizer& outer_;
  TrainingState state_;
  const FailureDrill& drill_;
  WorkerStates states_;
  const std::chrono::steady_clock::time_point born_ = std::chrono::steady_clock::now();
};

}  // namespace noloco
