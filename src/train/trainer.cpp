#include "train/trainer.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <ctime>
#include <filesystem>
#include <functional>
#include <optional>
#include <thread>

#include <fmt/format.h>

#include "comm/store/store_outage.h"
#include "comm/store/store_traffic.h"
#include "config/worker_env.h"
#include "data/dataset.h"
#include "model/generate.h"
#include "model/hf_directory.h"
#include "optim/flat_params.h"
#include "optim/inner.h"
#include "optim/outer.h"
#include "optim/subspace_constraint.h"
#include "pipeline/stage.h"
#include "pipeline/worker_model.h"
#include "train/checkpoint.h"
#include "train/checkpointer.h"
#include "train/evaluation.h"
#include "train/failure_drill.h"
#include "train/pace_record.h"
#include "train/rejoin.h"
#include "train/run_summary.h"
#include "train/telemetry.h"
#include "util/human.h"
#include "train/training_state.h"
#include "train/worker_life.h"
#include "util/compute_threads.h"
#include "util/error_text.h"
#include "util/files.h"
#include "util/log.h"
#include "util/process_stats.h"
#include "util/run_files.h"

namespace noloco {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

namespace {

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

WorkerTraffic traffic_of(const Worker& w, const WorkerModel& model) {
  WorkerTraffic t;
  t.replica = w.replica;
  t.worker = w.rank();
  t.stage = w.stage;
  if (w.transport()) t.comm = w.transport()->stats();
  t.pipeline = model.pipeline_stats();
  return t;
}

nlohmann::json record(int64_t step, const char* split, const Worker& w, const WorkerModel& model,
                      nlohmann::json fields) {
  fields["step"] = step;
  fields["split"] = split;
  traffic_of(w, model).add_to(fields);
  return fields;
}

std::unique_ptr<WorkerModel> make_worker_model(const TrainConfig& c, const ModelConfig& model, StepData data,
                                               torch::Device device, const Worker& w) {
  const StepOptions options{c.inner.batch,
                            c.inner.grad_accum,
                            c.eval.batches,
                            c.inner.batch * w.replica_workers,
                            c.run.precision == Precision::bf16,
                            c.run.seed,
                            c.init_from,
                            c.pipeline.activation_subspace,
                            c.pipeline.activation_subspace_token_std.value_or(0.0)};
  if (w.stages == 1) {
    // Each worker of a replica takes its own rows of the replica's batch.
    data.replica = w.layout().data_stream_of(w.rank());
    return make_whole_model(model, options, data, device);
  }
  return make_pipeline_stage(model, c.pipeline, options, data, device, {w.replica, w.replicas, w.stage, w.stages},
                             *w.rosters(), *w.stage_link(), activation_codecs(c));
}

// The worker's flat weights, kept in the model's residual subspace if it has one.
FlatParams flat_params_of(WorkerModel& model) {
  FlatParams flat(model.module());
  if (auto subspace = model.residual_subspace())
    flat.constrain(std::make_shared<const SubspaceConstraint>(std::move(subspace), flat));
  return flat;
}

// A sample of `tokens` from the model's current weights, for the progress log.
std::string sample_text(WorkerModel& model, const Tokenizer& tokenizer, const EvalConfig& e, int64_t tokens,
                        uint64_t seed) {
  auto* whole = model.whole_model();
  if (!whole) return "(no samples from a pipelined run; export it and use `noloco generate`)";
  SamplingOptions o;
  o.tokens = tokens;
  o.seed = seed;
  std::vector<int32_t> prompt;
  try {
    prompt = tokenizer.encode(e.sample_prompt);
  } catch (const std::invalid_argument&) {
    prompt.clear();  // a prompt outside the vocabulary: start from token 0
  }
  const auto ids = generate(*whole, prompt, o);
  return tokenizer.decode(std::vector<int32_t>(ids.begin() + long(prompt.size()), ids.end()));
}

// An evaluation's sample in the log: one line of its first tokens, so that
// the progress lines stay readable; the whole sample comes at the end.
constexpr int64_t kEvaluationSampleTokens = 40;
constexpr size_t kEvaluationSampleChars = 100;

// Tokens/s over the steps since the last progress line, and the time left.
class Throughput {
 public:
  Throughput(int64_t first_step, int64_t last_step) : first_(first_step), last_(last_step) {}
  void step(int64_t tokens, uint64_t activation_bytes) {
    tokens_ += tokens;
    total_tokens_ += tokens;
    steps_ += 1;
    activation_bytes_ = activation_bytes;
  }
  // Closes the window at `done` steps; adds its figures to `r`.
  void report(int64_t done, nlohmann::json& r) {
    r["tokens_per_s"] = double(tokens_) / std::max(seconds_since(window_), 1e-9);
    const double elapsed = seconds_since(start_);
    r["elapsed"] = elapsed;
    r["tokens"] = total_tokens_;  // since this process began, like `elapsed`: `report throughput=` takes windows
    r["eta_seconds"] = elapsed / double(done - first_) * double(last_ - done);
    if (r.contains("activation_bytes_sent"))
      r["activation_bytes_per_step"] = double(activation_bytes_ - window_activation_bytes_) / double(steps_);
    window_ = Clock::now();
    tokens_ = steps_ = 0;
    window_activation_bytes_ = activation_bytes_;
  }

 private:
  int64_t first_, last_;
  Clock::time_point start_ = Clock::now(), window_ = Clock::now();
  int64_t tokens_ = 0, steps_ = 0, total_tokens_ = 0;
  uint64_t activation_bytes_ = 0, window_activation_bytes_ = 0;
};

// What this worker's outer steps did: how many, the bytes they sent, and how
// long they held up training (all of an exchange without overlap; only the
// wait for one still in flight with it).
struct OuterTally {
  int64_t syncs = 0;
  // The outer steps of an exchanging method (not ddp's): with at least one
  // partner's message, and the longest run of them without. Those alone for
  // want of the run's store are its outage's (the summary's store_outages),
  // not the partners': left out of these.
  int64_t outer_steps = 0, paired = 0, alone_run = 0, longest_alone = 0;
  int64_t alone_without_store = 0;  // the outer steps the outage took
  int64_t handovers_served = 0, handovers_abandoned = 0;
  uint64_t bytes = 0;
  int64_t inner_steps = 0;  // trained by this process (after a resume: since it)
  // The slots it trained in (all of them but with pace=speed), and the
  // seconds from its first step to its last.
  int64_t trained_steps = 0;
  double loop_seconds = 0;
  int64_t values_received = 0, values_dropped = 0;  // of peers' messages
  double worst_dropped = 0;                         // the largest share of one outer step
  double blocked_seconds = 0;
  std::vector<int> refused_as_diverged;  // senders, one entry a refused message
  std::vector<int64_t> renewed_at_steps;
};

// What a link carried for training, per parameter and step (inner or outer).
double bits_per_param_per_step(uint64_t bytes, int64_t params, int64_t steps) {
  return 8.0 * double(bytes) / double(params) / double(steps);
}

// The share of peers' values that could not be used; 0 when none came.
double dropped_share(int64_t dropped, int64_t received) {
  return received > 0 ? double(dropped) / double(received) : 0.0;
}

// The figures of every worker of a replica, into the summary its first worker
// writes: they all finish together, and each adds its row over the
// replica's group (a mean, times the workers).
void gather_replica_workers(Collectives& replica, const Worker& w, const torch::Device& device,
                            WorkerSummary& summary) {
  auto rows = torch::zeros({int64_t(w.replica_workers), 5}, torch::kFloat64);
  rows[w.replica_worker].copy_(torch::tensor({double(w.rank()), double(int(device.type())), double(device.index()),
                                              summary.peak_rss_mib.value_or(0), summary.startup_seconds.value_or(0)},
                                             torch::kFloat64));
  replica.all_reduce_mean(rows);
  rows.mul_(double(w.replica_workers));
  const auto r = rows.accessor<double, 2>();
  summary.workers.clear();
  for (int64_t i = 0; i < rows.size(0); ++i) {
    const auto type = c10::DeviceType(std::lround(r[i][1]));
    const auto index = c10::DeviceIndex(std::lround(r[i][2]));
    summary.workers.push_back({int(std::lround(r[i][0])), torch::Device(type, index).str(), r[i][3], r[i][4]});
    summary.peak_rss_mib = std::max(summary.peak_rss_mib.value_or(0), r[i][3]);
    summary.startup_seconds = std::max(summary.startup_seconds.value_or(0), r[i][4]);
  }
}

// This worker's share of its replica's summary (worker_summary_path).
WorkerSummary summarize_worker(const TrainConfig& c, const Worker& w, const ModelConfig& arch, WorkerModel& model,
                               int64_t stage_params, double seconds, double val_loss, double last_loss,
                               const ReplicaSpread& spread, const std::optional<Rejoined>& rejoined,
                               const OuterTally& outer) {
  WorkerSummary summary;
  summary.method = c.outer.method;
  summary.replicas = w.replicas;
  summary.stages = w.stages;
  summary.replica = w.replica;
  summary.stage = w.stage;
  summary.routing = choice_name(c.pipeline.routing);
  summary.steps = c.inner.steps;
  // A replica's tokens: its first worker speaks for all of its workers.
  summary.tokens = c.inner.batch * c.inner.grad_accum * arch.context * c.inner.steps * w.replica_workers;
  summary.seconds = seconds;
  summary.params = arch.num_params();
  summary.stage_params = stage_params;
  summary.traffic = traffic_of(w, model);
  if (w.transport()) {
    summary.relays_used = w.transport()->relays_used();
    for (const auto& [peer, route] : w.transport()->routes()) summary.routes[peer] = route_name(route);
  }
  if (model.computes_loss() && std::isfinite(val_loss)) summary.final_val_loss = val_loss;
  if (model.computes_loss() && std::isfinite(last_loss)) summary.final_train_loss = last_loss;
  if (!std::isnan(spread.weight_std)) {
    summary.weight_std = spread.weight_std;
    summary.spread_replicas = spread.replicas;
    summary.live_replicas = spread.live_replicas;
  }
  if (!std::isnan(spread.mean_model_loss)) summary.final_val_loss_mean_model = spread.mean_model_loss;
  if (rejoined) summary.rejoin = WorkerSummary::Rejoin{rejoined->step, rejoined->donor, rejoined->seconds, rejoined->joined};
  // With fragments an outer step is each synchronisation of the fragment
  // then due (Streaming DiLoCo's schedule): one every interval/fragments steps.
  if (outer.syncs > 0) {
    summary.bits_per_param_per_outer_step = bits_per_param_per_step(outer.bytes, stage_params, outer.syncs);
    summary.steps_per_outer_step =
        c.outer.method == Method::ddp ? 1.0 : double(c.outer.interval) / double(c.outer.fragments);
  }
  if (outer.syncs > 0 && outer.inner_steps > 0)
    summary.bits_per_param_per_inner_step = bits_per_param_per_step(outer.bytes, stage_params, outer.inner_steps);
  if (outer.loop_seconds > 0) summary.trained_steps_per_second = double(outer.trained_steps) / outer.loop_seconds;
  if (outer.syncs > 0 && c.outer.method != Method::ddp)
    summary.trained_steps_per_outer_step = double(outer.trained_steps) / double(outer.syncs);
  if (outer.values_received > 0) {
    summary.dropped_fraction = dropped_share(outer.values_dropped, outer.values_received);
    summary.dropped_fraction_worst_outer_step = outer.worst_dropped;
  }
  if (w.transport()) summary.outer_blocked_seconds = outer.blocked_seconds;
  if (outer.outer_steps > 0) {
    summary.paired_fraction = double(outer.paired) / double(outer.outer_steps);
    summary.longest_alone_outer_steps = double(outer.longest_alone);
  }
  if (outer.outer_steps + outer.alone_without_store > 0 && w.membership())
    summary.outer_steps_alone_without_store = double(outer.alone_without_store);
  if (w.membership()) {
    summary.handovers_served = double(outer.handovers_served);
    summary.handovers_abandoned = double(outer.handovers_abandoned);
  }
  summary.refused_as_diverged = outer.refused_as_diverged;
  summary.renewed_at_steps = outer.renewed_at_steps;
  return summary;
}

// Where this worker starts: step 0, the latest checkpoint (resume=true), or,
// for a restarted NoLoCo worker or one that joins a running run, a live
// replica's state (not the disk); the other workers of such a replica take
// it from their first.
int64_t restore(const TrainConfig& c, const Worker& w, const WorkerModel& model, Checkpointer& checkpoints,
                const TrainingState& state, Telemetry& telemetry, WorkerLife& life, bool lead,
                std::optional<Rejoined>& rejoined) {
  if ((rejoined = life.start())) {
    const bool joining = rejoined->joined;
    if (w.replica_group()) share_state_within_replica(*w.replica_group(), state, rejoined->step);
    telemetry.write(record(rejoined->step, joining ? "join" : "rejoin", w, model,
                           {{"donor", rejoined->donor}, {"seconds", rejoined->seconds}}));
    if (joining)
      spdlog::info("joined the run as replica {}; took replica {}'s state at step {} in {:.1f}s", w.replica,
                   rejoined->donor, rejoined->step, rejoined->seconds);
    else
      spdlog::info("restarted (incarnation {}); took replica {}'s state at step {} in {:.1f}s",
                   w.membership()->incarnation(), rejoined->donor, rejoined->step, rejoined->seconds);
    return rejoined->step;
  }
  if (w.replica_group() && w.from_live_state) return share_state_within_replica(*w.replica_group(), state, 0);
  if (!c.run.resume) return 0;
  const auto steps = checkpoints.complete_steps();
  int64_t step = 0;
  if (w.agree_resume_step) {
    step = w.agree_resume_step(steps);
  } else {
    find_checkpoint(checkpoints.dir());  // refuses step directories none of which is complete
    step = steps.empty() ? 0 : steps.back();
  }
  checkpoints.resume_at(step);
  if (lead && step == 0) spdlog::info("resume=true but {} holds no checkpoint; starting from scratch", checkpoints.dir());
  if (lead && step > 0) spdlog::info("resumed from {} at step {}", checkpoints.dir(), step);
  return step;
}

void announce(const TrainConfig& c, const ModelConfig& arch, const Corpus& corpus, const torch::Device& device,
              const Worker& w, const std::string& out) {
  spdlog::info("{} model, {} parameters, {} training FLOPs/token, vocab {} ({}), {} train / {} val tokens",
               c.init_from.empty() ? c.preset : c.init_from,
               format_count(double(arch.num_params())), format_count(arch.train_flops_per_token()), arch.vocab_size,
               corpus.tokenizer->kind(), format_count(double(corpus.train.size())),
               format_count(double(corpus.val.size())));
  spdlog::info("method {}, {} replica(s), device {}, {} threads, run dir {}", choice_name(c.outer.method), w.replicas, device.str(),
               torch::get_num_threads(), out);
  if (!corpus.validates)
    spdlog::info("val_fraction=0: no validation; the run's losses are training losses, and its model is the mean "
                 "of its replicas");
  if (w.replica_workers > 1)
    spdlog::info("{} workers a replica: gradients averaged over them every step, {} sequences a step in all",
                 w.replica_workers, w.replica_workers * c.inner.batch * c.inner.grad_accum);
  if (w.stages > 1)
    spdlog::info("{} pipeline stages, {} routing, {} micro-batches per step ({})", w.stages,
                 choice_name(c.pipeline.routing), c.inner.grad_accum,
                 c.pipeline.schedule == Schedule::one_f_one_b ? "1F1B" : "GPipe");
  // Resolved for every seeded run; unset, an imported model keeps its own.
  if (const auto& token_std = c.pipeline.activation_subspace_token_std; c.pipeline.activation_subspace > 0)
    spdlog::info("residual stream kept in a {}-dimensional subspace of {} before the last stage (its o_proj, "
                 "down_proj and the embedding's trained part projected after every step{}); the embedding's frozen "
                 "part {}",
                 c.pipeline.activation_subspace, arch.hidden, c.init_from.empty() ? "" : "; the imported ones at start",
                 token_std ? fmt::format("at std {}", *token_std) : std::string("as imported"));
}

}  // namespace

std::string resolved_device(const std::string& configured, int local_rank) {
  const int gpus = torch::cuda::is_available() ? int(torch::cuda::device_count()) : 0;
  const auto name = worker_device(configured, local_rank, gpus);
  const torch::Device d(name);
  if (d.is_cuda() && d.index() >= gpus)
    throw std::invalid_argument(fmt::format("device={} but LibTorch sees {} CUDA device{}", configured, gpus,
                                            gpus == 1 ? "" : "s"));
  return name;
}

std::string default_run_dir(const TrainConfig& c) {
  std::time_t now = std::time(nullptr);
  char stamp[32];
  std::strftime(stamp, sizeof stamp, "%Y%m%d-%H%M%S", std::localtime(&now));
  return fmt::format("runs/{}-{}", c.outer.method == Method::none ? "single" : choice_name(c.outer.method), stamp);
}

namespace {

std::string prepared_run_dir(const TrainConfig& c) {
  const std::string out = c.run.out.empty() ? default_run_dir(c) : c.run.out;
  fs::create_directories(out);
  return out;
}

// Intra-op threads first: the device and the model are made under them.
torch::Device compute_device(const TrainConfig& c, const Worker& w) {
  const int cores = std::max(1, int(std::thread::hardware_concurrency()));
  set_compute_threads(c.run.threads > 0 ? int(c.run.threads) : std::max(1, cores / std::max(1, w.env.local_world)));
  return torch::Device(resolved_device(c.run.device, w.env.local_rank));
}

// Says when the run's store stops and starts answering.
void tell_store_news(StoreNews news, double store_outage_bound) {
  const auto& outage = store_outage();
  if (news == StoreNews::answers_again)
    spdlog::info("the run's store answers again after {}: exchanges resume at the next outer step",
                 format_duration(outage.last_seconds()));
  if (news == StoreNews::went_silent)
    spdlog::warn("the run's store does not answer ({}): training on alone and asking again each second; this worker "
                 "ends with a checkpoint if it stays away {} (store_outage)",
                 outage.why(), format_duration(store_outage_bound));
}

// What one inner step did, for the progress line.
struct InnerStepResult {
  double lr = 0, loss = std::nan(""), grad_norm = 0;
  int64_t micro_batches = 0;
  bool skipped = false;  // pace=speed: a slot this replica leaves to faster ones
};

// One worker's training: everything train() builds once, and the parts of
// its loop. The loop itself is train(), below.
class WorkerRun {
 public:
  WorkerRun(const TrainConfig& c, const Worker& w);
  int64_t first_step() const { return first_step_; }
  void before_step(int64_t step) const { life_.before_step(step); }
  InnerStepResult inner_step(int64_t step);
  // What the worker does after a step (its WorkerStates' answer): with
  // renew, a partner refused this replica as diverged and it took a live
  // replica's state, to go on from `renewed_step`.
  struct Next {
    LifeAction action = LifeAction::train_on;
    int64_t renewed_step = 0;
  };
  // After inner step `done` (1-based): the outer method's step, if one is due
  // (the last step also applies what is still in flight), then the rejoins it serves.
  Next outer_step(int64_t done, bool last);
  void log_progress(int64_t done, bool last, const InnerStepResult& s);
  // The mean over the replica's workers of this worker's `loss` (its own rows of the step's batch).
  double replica_loss(double loss);
  void evaluate(int64_t done, bool last, double lr);
  void checkpoint(int64_t done) { checkpoints_.after_step(done); }
  // Leaves the run after step `done`: what is in flight is applied, partners
  // are told not to wait for this replica, its state is saved; the summary
  // says when it left.
  nlohmann::json leave(int64_t done);
  // A pipeline worker that left: rosters frozen before it left still route
  // micro-batches through it. It serves those steps (forward and backward
  // for its neighbours, nothing applied to its own weights) until a roster
  // leaves it out, so that nobody loses a micro-batch or waits for it.
  void serve_listed_steps(int64_t from);
  // Ends the run here without its store: what is in flight is applied, the
  // state saved; the summary says why.
  nlohmann::json end_without_store(int64_t done);
  // Training stops after step `done`, before the last: what is in flight
  // settled by `settle` (its wait counted as blocked) and recorded, this
  // step's checkpoint saved.
  void stop_at(int64_t done, const std::function<std::vector<OuterSync>()>& settle);
  uint64_t activation_bytes_sent() const {
    const auto pipeline = model_->pipeline_stats();
    return pipeline ? pipeline->bytes_sent : 0;
  }
  // The outer method's hook on the gradients (DDP's all-reduce), tallied as
  // an outer step when it synchronised.
  void synchronise_gradients();
  nlohmann::json finish();

 private:
  void record_outer_steps(int64_t done, const std::vector<OuterSync>& syncs);
  // For the live page.
  void set_state(record::WorkerState state) const {
    if (w_.status()) w_.status()->set_state(state);
  }
  const TrainConfig& c_;
  const Worker& w_;
  const Clock::time_point start_ = Clock::now();
  const std::string out_;
  // The worker that prints: replica 0's, on the stage that sees the loss.
  const bool lead_;
  // It speaks for its replica: the replica's first worker (all do, with one a replica).
  const bool speaks_;
  const torch::Device device_;
  const Corpus corpus_;
  const ModelConfig arch_;
  const WindowSampler train_windows_, val_windows_;
  const std::unique_ptr<WorkerModel> model_;
  FlatParams flat_;
  InnerOptimizer inner_;
  const std::unique_ptr<OuterOptimizer> outer_;
  const TrainingState state_;
  const FailureDrill drill_;
  WorkerLife life_;
  Checkpointer checkpoints_;
  Telemetry telemetry_;
  std::optional<Rejoined> rejoined_;
  int64_t first_step_ = 0;

  const int64_t tokens_per_step_;
  uint64_t evaluation_bytes_ = 0;  // sent for evaluations across replicas, apart from training traffic
  double evaluation_seconds_ = 0;  // likewise: time to a target loss is training time, the rest is ours
  double val_loss_ = std::nan(""), last_loss_ = std::nan("");
  ReplicaSpread spread_;
  OuterTally tally_;
  std::optional<int64_t> left_at_step_;
  std::string store_gone_;                            // why it ended without the run's store
  std::optional<Throughput> throughput_;
  Pace* const pace_;        // pace=speed: which slots this replica trains in; null: all (or its first worker decides)
  std::optional<PaceRecord> pace_record_;  // pace=speed: the slots it trained in, for a resume to replay
  const double slowdown_;  // its steps stretched this many times (run.slowdown)
  double startup_seconds_ = 0;  // process start to the first step: data, model, restore
  StoreTraffic store_at_start_;  // what training asks of the store is counted from its first step
};

WorkerRun::WorkerRun(const TrainConfig& c, const Worker& w)
    : c_(c),
      w_(w),
      out_(prepared_run_dir(c)),
      lead_(w.replica == 0 && w.stage == w.stages - 1 && w.replica_worker == 0 && w.verbose),
      speaks_(w.replica_worker == 0),
      device_(compute_device(c, w)),
      corpus_(load_corpus(c.data, c.model.context, out_, c.run.resume)),
      arch_(with_vocabulary(c.model, *corpus_.tokenizer)),
      train_windows_(corpus_.train, arch_.context, c.run.seed),
      val_windows_(corpus_.val, arch_.context, kValidationSeed),
      model_(make_worker_model(c, arch_, {train_windows_, val_windows_, w.replica}, device_, w)),
      flat_(flat_params_of(*model_)),
      inner_(flat_, c.inner),
      outer_(make_outer_optimizer(c.outer, c.run.seed, {w.transport(), w.membership(), w.replica_group()}, flat_)),
      state_{flat_, inner_, *outer_},
      drill_(c.run.inject_crash, w.rank(), w.membership() ? w.membership()->incarnation() : int(w.from_live_state)),
      life_(c, w, flat_, *outer_, state_, drill_, c.comm.store_outage),
      checkpoints_(run_files::worker_checkpoints(out_, w.layout().speaker_of(w.rank())),
                   c.run.checkpoint_interval > 0 ? c.run.checkpoint_interval : c.eval.interval,
                   c.run.keep_checkpoints, c.inner.steps, arch_, out_,
                   {{"seed", c.run.seed},
                    {"method", choice_name(c.outer.method)},
                    {"replica", w.replica},
                    {"replicas", w.replicas},
                    {"stage", w.stage},
                    {"stages", w.stages}},
                   state_, drill_),
      telemetry_(out_, w.rank(), c.inner.steps, lead_ || (w.own_console && speaks_ && w.verbose),
                 [status = w.status()](const nlohmann::json& r) {
                   if (status) status->record(r);
                 }),
      tokens_per_step_(c.inner.batch * c.inner.grad_accum * arch_.context * w.replica_workers),
      pace_(outer_->pace()),
      slowdown_(slowdown_of(c.run.slowdown, w.replica)) {
  if (lead_) announce(c, arch_, corpus_, device_, w, out_);
  if (!speaks_) checkpoints_.follow();
  set_state(life_.takes_live_state() ? record::WorkerState::joining : record::WorkerState::starting);
  first_step_ = restore(c, w, *model_, checkpoints_, state_, telemetry_, life_, lead_, rejoined_);
  if (pace_) {  // a live replica's state starts a record of its own
    pace_record_.emplace(run_files::in(checkpoints_.dir(), run_files::kPaceSlots), first_step_, c.inner.steps,
                         c.run.resume && !w.from_live_state);
    pace_->replay(first_step_, pace_record_->replay());
  }
  // Only now: a resume refused above leaves the run's config as it was.
  if (w.rank() == 0) {
    auto recorded = c;
    recorded.data.tokenizer = corpus_.tokenizer_source;
    write_file_atomic(run_files::in(out_, run_files::kConfig), recorded.to_yaml());
    const auto imported = out_ + "/" + kImportedHfConfig;
    if (!c.init_from.empty() && !std::filesystem::exists(imported))
      write_file_atomic(imported, read_file(c.init_from + "/config.json"));
  }
  throughput_.emplace(first_step_, c.inner.steps);
  startup_seconds_ = seconds_since_process_start();
  set_state(record::WorkerState::training);
  store_at_start_ = store_traffic();
}

InnerStepResult WorkerRun::inner_step(int64_t step) {
  InnerStepResult s;
  s.lr = learning_rate(c_.inner, step);
  const bool trains = outer_->trains_at(step);
  if (pace_record_) pace_record_->note(step, trains);
  if (!trains) {
    s.skipped = true;
    throughput_->step(0, activation_bytes_sent());
    return s;
  }
  const auto start = Clock::now();
  inner_.set_lr(s.lr);
  flat_.grads().zero_();
  const StepOutcome outcome = model_->train_step(step);
  s.loss = outcome.loss;
  s.micro_batches = outcome.micro_batches;
  if (model_->computes_loss() && outcome.micro_batches > 0 && !std::isfinite(s.loss))
    throw std::runtime_error(fmt::format("loss became {} at step {} (lower lr?)", s.loss, step));
  // A pipeline worker whose micro-batches were all dropped (or that sits out
  // the step, restarted and not yet routed to) has nothing to apply.
  if (outcome.micro_batches > 0) {
    synchronise_gradients();
    flat_.project_change(flat_.grads());
    s.grad_norm = inner_.clip_gradients(c_.inner.clip);
    inner_.step();
    flat_.project_weights(flat_.values());
  }
  if (std::isfinite(s.loss)) last_loss_ = s.loss;
  if (slowdown_ > 1) std::this_thread::sleep_for(std::chrono::duration<double>((slowdown_ - 1) * seconds_since(start)));
  if (pace_) pace_->step_took(seconds_since(start));
  ++tally_.trained_steps;
  throughput_->step(s.micro_batches > 0 ? tokens_per_step_ : 0, activation_bytes_sent());
  return s;
}

void WorkerRun::synchronise_gradients() {
  const auto start = Clock::now();
  const uint64_t sent_before = w_.transport() ? w_.transport()->stats().bytes_sent : 0;
  if (!outer_->on_gradients(flat_)) return;
  ++tally_.syncs;
  tally_.bytes += w_.transport()->stats().bytes_sent - sent_before;
  tally_.blocked_seconds += seconds_since(start);
}

WorkerRun::Next WorkerRun::outer_step(int64_t done, bool last) {
  const auto after = life_.after_inner_step(done, last);
  tell_store_news(after.store, c_.comm.store_outage);
  tally_.blocked_seconds += after.blocked_seconds;
  record_outer_steps(done, after.syncs);
  for (int to : after.handovers.served) telemetry_.write(record(done, "donate", w_, *model_, {{"to", to}}));
  for (int to : after.handovers.abandoned)
    telemetry_.write(record(done, "donate", w_, *model_, {{"to", to}, {"abandoned", true}}));
  tally_.handovers_served += int64_t(after.handovers.served.size());
  tally_.handovers_abandoned += int64_t(after.handovers.abandoned.size());
  if (!after.renewed) return {after.next};
  const auto& renewed = *after.renewed;
  if (pace_) pace_->replay(renewed.step, {});  // what it recorded after that step was another state's
  telemetry_.write(record(renewed.step, "rejoin", w_, *model_,
                          {{"donor", renewed.donor}, {"seconds", renewed.seconds}, {"refused_at_step", done}}));
  spdlog::info("took replica {}'s state at step {} in {:.1f}s, a partner having refused it as diverged (read at "
               "step {})",
               renewed.donor, renewed.step, renewed.seconds, done);
  tally_.renewed_at_steps.push_back(renewed.step);
  return {after.next, renewed.step};
}

nlohmann::json WorkerRun::leave(int64_t done) {
  spdlog::info("worker {} leaves the run after step {} (SIGTERM)", w_.rank(), done);
  set_state(record::WorkerState::left);
  stop_at(done, [&] { return life_.leave(); });
  if (w_.stage_link()) serve_listed_steps(done);
  return finish();
}

void WorkerRun::stop_at(int64_t done, const std::function<std::vector<OuterSync>()>& settle) {
  const auto start = Clock::now();
  const auto in_flight = settle();
  tally_.blocked_seconds += seconds_since(start);
  record_outer_steps(done, in_flight);
  checkpoints_.save(done);
  left_at_step_ = done;
}

nlohmann::json WorkerRun::end_without_store(int64_t done) {
  store_gone_ = fmt::format("the run's store did not answer for {} ({})", format_duration(c_.comm.store_outage),
                            store_outage().why());
  spdlog::error("{}: this worker ends after step {} with its checkpoint and its summary", store_gone_, done);
  stop_at(done, [&] { return outer_->finish(flat_); });
  return finish();
}

void WorkerRun::serve_listed_steps(int64_t from) {
  model_->leave_pipeline();
  try {
    for (int64_t step = from; step < c_.inner.steps; ++step) {
      flat_.grads().zero_();
      model_->train_step(step);
      if (!model_->listed()) return;
    }
  } catch (const std::exception& e) {
    // Its state is saved: what is lost is a neighbour's micro-batch, which that neighbour reports.
    spdlog::info("stopped serving the pipeline after leaving: {}", error_text(e));
  }
}

void WorkerRun::record_outer_steps(int64_t done, const std::vector<OuterSync>& syncs) {
  for (const auto& sync : syncs) {
    ++tally_.syncs;
    tally_.bytes += sync.bytes;
    tally_.values_received += sync.values_received;
    tally_.values_dropped += sync.values_dropped;
    const double dropped = dropped_share(sync.values_dropped, sync.values_received);
    tally_.worst_dropped = std::max(tally_.worst_dropped, dropped);
    tally_.refused_as_diverged.insert(tally_.refused_as_diverged.end(), sync.refused.begin(), sync.refused.end());
    if (sync.store_unreachable) {
      ++tally_.alone_without_store;
    } else {
      ++tally_.outer_steps;
      if (sync.arrived.size() > 1) {
        ++tally_.paired;
        tally_.alone_run = 0;
      } else {
        tally_.longest_alone = std::max(tally_.longest_alone, ++tally_.alone_run);
      }
    }
    auto r = record(done, "outer", w_, *model_,
                            {{"outer_step", sync.outer_step},
                             {"fragment", sync.fragment},
                             {"members", sync.members},
                             {"group", sync.group},
                             {"arrived", sync.arrived},
                             {"bytes", sync.bytes},
                             {"phi_blocks_failed", sync.phi_blocks_failed},
                             {"dropped_fraction", dropped}});
    if (sync.largest_increment_ratio > 0) r["largest_increment_ratio"] = sync.largest_increment_ratio;
    if (!sync.refused.empty()) r["refused_as_diverged"] = sync.refused;
    if (sync.store_unreachable) r["store_unreachable"] = true;
    if (!sync.behind.empty()) r["left_behind"] = sync.behind;
    if (sync.left_behind_by > 0) r["was_left_behind"] = true;
    if (sync.pace) {  // pace=speed: the steps behind each increment of the merge
      r["trained_steps"] = sync.pace->steps;
      for (const auto& [partner, report] : sync.partners_pace)  // a note heard when left behind weighs nothing
        if (std::find(sync.arrived.begin(), sync.arrived.end(), partner) != sync.arrived.end())
          r["partners_trained_steps"][std::to_string(partner)] = report.steps;
    }
    if (w_.transport()) {
      // Each partner's link, as it went (direct, punched, relayed).
      const auto routes = w_.transport()->routes();
      for (int member : sync.group)
        if (const auto it = routes.find(member); it != routes.end() && member != w_.transport()->rank())
          r["routes"][std::to_string(member)] = route_name(it->second);
    }
    telemetry_.write(r);
  }
}

double WorkerRun::replica_loss(double loss) {
  if (!w_.replica_group()) return loss;
  auto mean = torch::full({1}, loss, torch::kFloat64);
  w_.replica_group()->all_reduce_mean(mean);
  return mean.item<double>();
}

void WorkerRun::log_progress(int64_t done, bool last, const InnerStepResult& s) {
  if (done % c_.eval.log_interval != 0 && !last) return;
  const double loss = replica_loss(s.loss);
  if (std::isfinite(loss)) last_loss_ = loss;
  if (!speaks_) return;
  auto r = record(done, "train", w_, *model_, {{"lr", s.lr}, {"grad_norm", s.grad_norm}});
  if (w_.transport()) {
    r["outer_blocked_seconds"] = tally_.blocked_seconds;
    r["bits_per_param_per_inner_step"] = bits_per_param_per_step(tally_.bytes, flat_.numel(), done - first_step_);
  }
  if (std::isfinite(loss)) r["loss"] = loss;
  if (pace_)
    r.update({{"period_steps", pace_->period_steps()},
              {"outer_interval", c_.outer.interval},
              {"step_seconds", pace_->step_seconds()},
              {"reference_step_seconds", pace_->reference_seconds()},
              {"trained_steps", pace_->trained_steps()}});
  throughput_->report(done, r);
  telemetry_.write(r);
}

void WorkerRun::evaluate(int64_t done, bool last, double lr) {
  if (!speaks_) return;  // its weights are its replica's first worker's
  const auto evaluation_start = Clock::now();
  val_loss_ = corpus_.validates ? model_->evaluate(done) : std::nan("");
  spread_ = ReplicaSpread{};  // a validation without the spread logs none, not the previous one
  const bool across_replicas = w_.transport() && w_.membership() && w_.replicas > 1;
  if (across_replicas && (last || c_.eval.spread_interval == 0 || done % c_.eval.spread_interval == 0)) {
    spread_ = evaluate_across_replicas(done, c_.run.seed, c_.eval.spread_replicas, *w_.transport(), *w_.membership(),
                                       flat_, *model_, corpus_.validates);
    evaluation_bytes_ += spread_.bytes_sent;
  }
  evaluation_seconds_ += seconds_since(evaluation_start);
  // So that `report target_loss=` can time runs to a loss.
  auto r = record(done, "val", w_, *model_,
                  {{"lr", lr}, {"elapsed", seconds_since(start_)}, {"evaluation_seconds", evaluation_seconds_}});
  if (std::isfinite(val_loss_)) r["loss"] = val_loss_;
  if (!std::isnan(spread_.weight_std))
    r.update({{"weight_std", spread_.weight_std}, {"spread_replicas", spread_.replicas},
              {"live_replicas", spread_.live_replicas}});
  if (!std::isnan(spread_.weight_std) && w_.stages > 1) r["stage_params"] = flat_.numel();
  if (!std::isnan(spread_.mean_model_loss)) r["loss_mean_model"] = spread_.mean_model_loss;
  if (w_.transport()) r["eval_bytes_sent"] = evaluation_bytes_;
  if (const auto pipeline = model_->pipeline_stats()) r["eval_activation_bytes_sent"] = pipeline->evaluation_bytes_sent;
  telemetry_.write(r);
  if (lead_ && c_.eval.sample_tokens > 0 && !last) {
    const auto tokens = std::min(c_.eval.sample_tokens, kEvaluationSampleTokens);
    spdlog::info("sample: {}", one_line(sample_text(*model_, *corpus_.tokenizer, c_.eval, tokens,
                                                    c_.run.seed + uint64_t(done)),
                                        kEvaluationSampleChars));
  }
}

nlohmann::json WorkerRun::finish() {
  if (first_step_ == c_.inner.steps && speaks_ && corpus_.validates)
    val_loss_ = model_->evaluate(first_step_);  // resumed at the end
  tally_.inner_steps = left_at_step_.value_or(c_.inner.steps) - first_step_;
  tally_.loop_seconds = seconds_since_process_start() - startup_seconds_;
  auto summary = summarize_worker(c_, w_, arch_, *model_, flat_.numel(), seconds_since(start_), val_loss_, last_loss_,
                                  spread_, rejoined_, tally_);
  summary.device = device_.str();  // device=cuda resolved to this worker's GPU
  if (pace_) summary.tokens = tokens_per_step_ * pace_->trained_steps();
  summary.left_at_step = left_at_step_;
  summary.store_gone = store_gone_;
  summary.store_outages = store_outage().count();
  summary.store_outage_seconds = store_outage().total_seconds();
  summary.peak_rss_mib = peak_rss_mib();
  summary.startup_seconds = startup_seconds_;
  const auto store = store_traffic();
  if (tally_.outer_steps > 0 && store.requests > store_at_start_.requests) {
    summary.store_requests_per_outer_step = double(store.requests - store_at_start_.requests) / tally_.outer_steps;
    summary.store_kib_read_per_outer_step =
        double(store.bytes_read - store_at_start_.bytes_read) / 1024 / tally_.outer_steps;
  }
  if (w_.replica_group()) gather_replica_workers(*w_.replica_group(), w_, device_, summary);
  const auto j = summary.to_json();
  // One summary per replica (a worker in a pipeline), by its first worker.
  if (speaks_) write_json_atomic(worker_summary_path(out_, w_.layout(), w_.rank()), j);
  if (!left_at_step_) set_state(record::WorkerState::finished);
  try {
    // Before the run hears it finished: a launcher then takes its store down.
    if (w_.status()) w_.status()->flush();
    // Only now: a launcher waiting for a joiner to finish reads its summary next.
    life_.end_membership(j.dump());
  } catch (const StoreUnreachable& e) {
    spdlog::warn("the run's store did not hear this worker finish (its summary is in {}): {}", out_, e.what());
  }
  if (lead_) {
    const auto loss = corpus_.validates ? fmt::format("final val loss {:.4f} (ppl {:.2f})", val_loss_,
                                                      std::exp(val_loss_))
                                        : fmt::format("final train loss {:.4f} (no validation)", last_loss_);
    spdlog::info("done: {} | {} steps | {} tokens | {} | {} params", loss, left_at_step_.value_or(c_.inner.steps),
                 format_count(double(summary.tokens)), format_duration(summary.seconds),
                 format_count(double(arch_.num_params())));
    if (c_.eval.sample_tokens > 0)
      spdlog::info("sample:\n{}",
                   sample_text(*model_, *corpus_.tokenizer, c_.eval, c_.eval.sample_tokens,
                               c_.run.seed + uint64_t(c_.inner.steps)));
    spdlog::info("run dir: {}", out_);
  }
  return j;
}

}  // namespace

nlohmann::json train(const TrainConfig& c, const Worker& w) {
  WorkerRun run(c, w);
  for (int64_t step = run.first_step(); step < c.inner.steps; ++step) {
    run.before_step(step);
    const auto inner = run.inner_step(step);
    const int64_t done = step + 1;
    const bool last = done == c.inner.steps;
    const auto next = run.outer_step(done, last);
    if (next.action == LifeAction::renew) {
      step = next.renewed_step - 1;  // on from the live replica's step
      // The others evaluate at that step, and their group holds this replica (issue 67 drills: they waited peer_timeout).
      if (next.renewed_step % c.eval.interval == 0) run.evaluate(next.renewed_step, false, inner.lr);
      continue;
    }
    run.log_progress(done, last, inner);
    if (done % c.eval.interval == 0 || last) run.evaluate(done, last, inner.lr);
    // Before the periodic checkpoint: leaving writes this step's own (after what was in flight is applied).
    if (next.action == LifeAction::leave) return run.leave(done);
    if (next.action == LifeAction::end_without_store) return run.end_without_store(done);
    run.checkpoint(done);
  }
  return run.finish();
}

}  // namespace noloco
