#include "train/worker_life.h"

#include <algorithm>
#include <chrono>
#include <thread>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "comm/membership/membership.h"
#include "comm/store/store.h"
#include "comm/store/store_outage.h"
#include "config/run_layout.h"
#include "train/trainer.h"
#include "util/leave_signal.h"
#include "util/log.h"

namespace noloco {

namespace {

using Clock = std::chrono::steady_clock;

// Its place in the run, from how it came in and its connections.
void place(Worker& w, const TrainConfig& config, const WorkerStart& start, bool leaves) {
  const auto& env = start.env;
  const RunLayout layout(int(config.pipeline.stages), int(config.run.replica_workers));
  w.stages = layout.stages();
  w.stage = layout.stage_of(env.rank);
  w.replica_workers = layout.replica_workers();
  w.replica_worker = layout.replica_worker_of(env.rank);
  w.replica = layout.replica_of(env.rank);
  w.replicas = env.world / layout.workers_per_replica();
  w.from_live_state = start.joins || env.restart > 0;
  // Our launcher's workers share its terminal (and reach its store over a unix socket).
  w.own_console = env.local_rank == 0 && (start.joins || env.store_url.rfind("unix://", 0) != 0);
  // A joiner starts from a live replica's state, never from the disk; a lone worker takes its newest.
  if (!start.joins && w.links.store) {
    const auto timeout = std::max(std::chrono::milliseconds(600000), w.links.timeout);
    w.agree_resume_step = [store = w.links.store, env, layout, timeout](const std::vector<int64_t>& steps) {
      return agree_resume_step(store, env.token, env.rank, env.world, layout, steps, timeout);
    };
  }
  if (leaves) w.leave_requested = noloco::leave_requested;
}

// Every worker of a run trains the same model the same way: worker 0
// publishes its run keys in the run's store, the others compare theirs (a
// worker 0 that never comes: the first to give up waiting publishes). Before
// this, a worker with another model aborted inside Gloo at its first exchange
// (a message longer than the one it expected) while its peer trained alone,
// and one with another lr went unnoticed.
void agree_on_run_config(const StorePtr& store, const WorkerEnv& env, const TrainConfig& config,
                         const std::string& user_model) {
  const auto ours = config.run_yaml() + (user_model.empty() ? "" : "user_model: " + user_model + "\n");
  const auto scope = run_scope(store, env.token, record::kRun);
  if (env.rank != 0) {
    // Polled: torchrun's TCPStore (1.13) wakes no waiter on a compareSet.
    const double wait = std::max(config.comm.peer_timeout, config.comm.startup_timeout);
    const auto until = Clock::now() + std::chrono::duration<double>(wait);
    while (!scope->check({record::kConfig}) && Clock::now() < until)
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    if (!scope->check({record::kConfig}))
      spdlog::warn("worker 0 published no config within {:.0f} s: this worker's is the run's", wait);
  }
  const auto run = set_once(*scope, record::kConfig, ours);
  const auto differences = run_yaml_differences(ours, run);
  if (!differences.empty())
    throw std::invalid_argument(fmt::format(
        "worker {} was started with another config than the run's: {}; only a machine's own keys ({}) may differ",
        env.rank, differences, fmt::join(machine_keys(), ", ")));
}

}  // namespace

std::string published_run_config(const StorePtr& store, const std::string& token) {
  return read_or_empty(*run_scope(store, token, record::kRun), record::kConfig);
}

bool leaves_on_sigterm(const TrainConfig& config, int stages) {
  return takes_joiners(config.outer.method, config.pipeline.routing, stages) && config.run.replica_workers == 1;
}

Worker start_worker(const TrainConfig& config, const WorkerStart& start) {
  const auto& env = start.env;
  Worker w;
  w.env = env;
  // Nobody to exchange with, hand state to or agree with: no store, no groups.
  const bool alone = env.world == 1 && !start.joins && config.outer.method == Method::none;
  if (!alone) init_logging(fmt::format("noloco[{} {}]", start.log_name, env.rank));
  // Not yet joined, a worker cannot ask the store which start this is; its
  // launcher tells a restart by its environment.
  if (env.restart == 0) FailureDrill(config.run.inject_crash, env.rank, 0).at_startup();
  if (alone) {
    place(w, config, start, false);
    return w;
  }
  const int stages = int(config.pipeline.stages);
  // SIGTERM asks it to leave only from its first step on (util/leave_signal.h).
  const bool leaves = leaves_on_sigterm(config, stages);
  // The replica's own group runs over NCCL on this worker's GPU where it can.
  const auto nccl_device =
      uses_nccl(config.run.device, config.comm) ? resolved_device(config.run.device, env.local_rank) : "";
  w.links = join_as_worker(env, config.comm, stages, config.outer.method != Method::none,
                           int(config.run.replica_workers), nccl_device);
  if (w.links.store) {
    try {
      agree_on_run_config(w.links.store, env, config, start.user_model);
    } catch (const std::invalid_argument& refused) {
      // Partners would otherwise wait out its heartbeat at their first exchange.
      if (w.membership()) w.membership()->refuse(refused.what());
      throw;
    }
  }
  place(w, config, start, leaves);
  return w;
}

void finish_worker(const Worker& worker) { outlast_store_users(worker.links); }

namespace {

LifeRules life_rules(const TrainConfig& config, const Worker& worker, std::optional<double> store_outage) {
  LifeRules rules;
  rules.takes_back = takes_back_restarted(config.outer.method, config.pipeline.routing, worker.stages);
  // A replica of several workers cannot take a state for all of them at once mid-run.
  rules.renews = rules.takes_back && worker.replica_workers == 1;
  rules.store_outage = store_outage;
  return rules;
}

}  // namespace

WorkerLife::WorkerLife(const TrainConfig& config, const Worker& worker, FlatParams& flat, OuterOptimizer& outer,
                       const TrainingState& state, const FailureDrill& drill, std::optional<double> store_outage)
    : config_(config),
      worker_(worker),
      flat_(flat),
      outer_(outer),
      state_(state),
      drill_(drill),
      states_(life_rules(config, worker, store_outage)) {}

bool WorkerLife::takes_live_state() const {
  return worker_.membership() && (worker_.membership()->incarnation() > 0 || worker_.membership()->joining());
}

std::optional<Rejoined> WorkerLife::start() {
  const bool from_live_state = takes_live_state();
  const auto action = states_.start(from_live_state);
  if (!from_live_state) return std::nullopt;
  const bool joining = worker_.membership()->joining();
  if (action == LifeAction::refuse)
    throw std::runtime_error(fmt::format("worker {} was {}, but only a noloco run can take it {}", worker_.rank(),
                                         joining ? "started to join" : "restarted", joining ? "in" : "back"));
  spdlog::info("worker {} {}: waiting for a live replica's state at its next outer step", worker_.rank(),
               joining ? "joins the run" : fmt::format("was restarted ({})", worker_.membership()->incarnation()));
  auto rejoined =
      rejoin_from_peer(*worker_.membership(), *worker_.transport(), state_, rejoin_timeout(config_.comm), drill_);
  rejoined.joined = joining;
  states_.state_taken();
  return rejoined;
}

void WorkerLife::before_step(int64_t step) const {
  if (worker_.leave_requested) leave_on_sigterm();
  drill_.before_step(step);
  if (drill_.corrupts_before(step) && worker_.transport()) worker_.transport()->corrupt_next_message();
  if (drill_.diverges_before(step)) {
    torch::NoGradGuard no_grad;
    flat_.values().add_(torch::randn_like(flat_.values()));
  }
}

AfterStep WorkerLife::after_inner_step(int64_t done, bool last) {
  AfterStep after;
  // Its partners' waits for it see it moving on.
  if (worker_.membership()) worker_.membership()->progressed();
  const auto start = Clock::now();
  if (auto sync = outer_.after_inner_step(done - 1, flat_)) after.syncs.push_back(std::move(*sync));
  if (last)  // exchanges still in flight (overlap) are applied before the final evaluation
    for (auto& sync : outer_.finish(flat_)) after.syncs.push_back(std::move(sync));
  const auto diverged =
      std::find_if(after.syncs.begin(), after.syncs.end(), [](const OuterSync& s) { return s.diverged; });
  StepFacts facts;
  facts.last = last;
  facts.diverged = diverged != after.syncs.end();
  facts.leave_asked = worker_.leave_requested && worker_.leave_requested();
  facts.store_silent_for = store_outage().seconds().count();
  const auto verdict = states_.after_step(std::chrono::duration<double>(Clock::now() - born_).count(), facts);
  after.next = verdict.action;
  after.store = verdict.store;
  if (verdict.action == LifeAction::renew) {
    after.renewed = renew(diverged->outer_step, done);
    states_.state_taken();
  }
  after.blocked_seconds = std::chrono::duration<double>(Clock::now() - start).count();
  if (!after.syncs.empty() && worker_.membership() && !last && !after.renewed)
    after.handovers = serve_rejoins(*worker_.membership(), *worker_.transport(), state_, done);
  return after;
}

Rejoined WorkerLife::renew(int64_t outer_step, int64_t step) {
  spdlog::error("worker {}: a partner refused its message as diverged (read after outer step {}); taking a live "
                "replica's state at that replica's next outer step",
                worker_.rank(), outer_step);
  outer_.finish(flat_);  // an exchange in flight would land on the state taken
  worker_.membership()->renew(outer_step, step);
  return rejoin_from_peer(*worker_.membership(), *worker_.transport(), state_, rejoin_timeout(config_.comm), drill_);
}

std::vector<OuterSync> WorkerLife::leave() {
  if (worker_.membership()) worker_.membership()->begin_leaving();
  auto in_flight = outer_.finish(flat_);
  if (worker_.membership()) worker_.membership()->leave();
  return in_flight;
}

void WorkerLife::end_membership(const std::string& summary) const {
  if (worker_.membership()) worker_.membership()->finish(summary);
}

}  // namespace noloco
