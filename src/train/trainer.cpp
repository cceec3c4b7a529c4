#include "train/trainer.h"

#include <chrono>
#include <ctime>
#include <filesystem>
#include <optional>
#include <thread>

#include <fmt/format.h>

#include "data/dataset.h"
#include "model/generate.h"
#include "optim/flat_params.h"
#include "optim/inner.h"
#include "optim/outer.h"
#include "pipeline/stage.h"
#include "pipeline/worker_model.h"
#include "train/checkpoint.h"
#include "train/checkpointer.h"
#include "train/evaluation.h"
#include "train/failure_drill.h"
#include "train/rejoin.h"
#include "train/run_summary.h"
#include "train/telemetry.h"
#include "util/human.h"
#include "train/training_state.h"
#include "util/compute_threads.h"
#include "util/files.h"
#include "util/log.h"

namespace noloco {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

namespace {

// Validation windows are the same for every run, so runs can be compared.
constexpr uint64_t kEvalSeed = 0x5eedba11;

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

torch::Device pick_device(const std::string& name) {
  torch::Device d(name);
  if (d.is_cuda() && !torch::cuda::is_available())
    throw std::runtime_error(fmt::format("device={} but no CUDA device is available to LibTorch", name));
  return d;
}

WorkerTraffic traffic_of(const WorkerInfo& w) {
  WorkerTraffic t;
  t.replica = w.replica;
  t.worker = w.rank;
  t.stage = w.stage;
  if (w.transport) t.comm = w.transport->stats();
  if (w.link) t.pipeline = w.link->stats();
  return t;
}

nlohmann::json record(int64_t step, const char* split, const WorkerInfo& w, nlohmann::json fields) {
  fields["step"] = step;
  fields["split"] = split;
  traffic_of(w).add_to(fields);
  return fields;
}

std::unique_ptr<WorkerModel> make_worker_model(const TrainConfig& c, const ModelConfig& model, StepData data,
                                               torch::Device device, const WorkerInfo& w) {
  const StepOptions options{c.inner.batch, c.inner.grad_accum, c.eval.batches, c.run.precision == Precision::bf16,
                            c.run.seed, c.init_from};
  if (w.stages == 1) return make_whole_model(model, options, data, device);
  return make_pipeline_stage(model, c.pipeline, options, data, device, {w.replica, w.replicas, w.stage, w.stages},
                             *w.link);
}

// A sample from the model's current weights, for the progress log.
std::string sample_text(WorkerModel& model, const Tokenizer& tokenizer, const EvalConfig& e, uint64_t seed) {
  auto* whole = model.whole_model();
  if (!whole) return "(no samples from a pipelined run; export it and use `noloco generate`)";
  SamplingOptions o;
  o.tokens = e.sample_tokens;
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
  uint64_t bytes = 0;
  double blocked_seconds = 0;
};

// This worker's summary_r<k>.json.
WorkerSummary summarize_worker(const TrainConfig& c, const WorkerInfo& w, const ModelConfig& arch, WorkerModel& model,
                               int64_t stage_params, double seconds, double val_loss, double last_loss,
                               const ReplicaSpread& spread, const std::optional<Rejoined>& rejoined,
                               const OuterTally& outer) {
  WorkerSummary summary;
  summary.method = choice_name(c.outer.method);
  summary.replicas = w.replicas;
  summary.stages = w.stages;
  summary.routing = choice_name(c.pipeline.routing);
  summary.steps = c.inner.steps;
  summary.tokens = c.inner.batch * c.inner.grad_accum * arch.context * c.inner.steps;
  summary.seconds = seconds;
  summary.params = arch.num_params();
  summary.stage_params = stage_params;
  summary.device = c.run.device;
  summary.traffic = traffic_of(w);
  if (model.computes_loss() && std::isfinite(val_loss)) summary.final_val_loss = val_loss;
  if (model.computes_loss() && std::isfinite(last_loss)) summary.final_train_loss = last_loss;
  if (!std::isnan(spread.weight_std)) summary.weight_std = spread.weight_std;
  if (!std::isnan(spread.mean_model_loss)) summary.final_val_loss_mean_model = spread.mean_model_loss;
  if (rejoined) summary.rejoin = WorkerSummary::Rejoin{rejoined->step, rejoined->donor, rejoined->seconds};
  if (outer.syncs > 0)
    summary.bits_per_param_per_outer_step = 8.0 * double(outer.bytes) / double(outer.syncs) / double(stage_params);
  if (w.transport) summary.outer_blocked_seconds = outer.blocked_seconds;
  return summary;
}

// Where this worker starts: step 0, the latest checkpoint (resume=true), or,
// for a restarted NoLoCo worker, a live replica's state (not the disk).
int64_t restore(const TrainConfig& c, const WorkerInfo& w, Checkpointer& checkpoints, const TrainingState& state,
                Telemetry& telemetry, bool lead, std::optional<Rejoined>& rejoined) {
  if (w.membership && w.membership->incarnation() > 0) {
    if (!takes_back_restarted(c.outer.method, c.pipeline.routing, w.stages))
      throw std::runtime_error(fmt::format("worker {} was restarted, but only a noloco run can take it back", w.rank));
    const auto timeout = std::max(std::chrono::milliseconds(int64_t(c.comm.peer_timeout * 1000)),
                                  std::chrono::milliseconds(600000));
    rejoined = rejoin_from_peer(*w.membership, *w.transport, state, timeout);
    telemetry.write(record(rejoined->step, "rejoin", w, {{"donor", rejoined->donor}, {"seconds", rejoined->seconds}}));
    spdlog::info("restarted (incarnation {}); took replica {}'s state at step {} in {:.1f}s",
                 w.membership->incarnation(), rejoined->donor, rejoined->step, rejoined->seconds);
    return rejoined->step;
  }
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
              const WorkerInfo& w, const std::string& out) {
  spdlog::info("{} model, {} parameters, {} training FLOPs/token, vocab {} ({}), {} train / {} val tokens",
               c.init_from.empty() ? c.preset : c.init_from,
               format_count(double(arch.num_params())), format_count(arch.train_flops_per_token()), arch.vocab_size,
               corpus.tokenizer->kind(), format_count(double(corpus.train.numel())),
               format_count(double(corpus.val.numel())));
  spdlog::info("method {}, {} replica(s), device {}, {} threads, run dir {}", choice_name(c.outer.method), w.replicas, device.str(),
               torch::get_num_threads(), out);
  if (w.stages > 1)
    spdlog::info("{} pipeline stages, {} routing, {} micro-batches per step ({})", w.stages,
                 choice_name(c.pipeline.routing), c.inner.grad_accum,
                 c.pipeline.schedule == Schedule::one_f_one_b ? "1F1B" : "GPipe");
}

}  // namespace

std::string default_run_dir(const TrainConfig& c) {
  std::time_t now = std::time(nullptr);
  char stamp[32];
  std::strftime(stamp, sizeof stamp, "%Y%m%d-%H%M%S", std::localtime(&now));
  return fmt::format("runs/{}-{}", c.outer.method == Method::none ? "single" : choice_name(c.outer.method), stamp);
}

nlohmann::json train(const TrainConfig& c, const WorkerInfo& w) {
  const auto start = Clock::now();
  const std::string out = c.run.out.empty() ? default_run_dir(c) : c.run.out;
  fs::create_directories(out);
  // The worker that prints: replica 0's, on the stage that sees the loss.
  const bool lead = w.replica == 0 && w.stage == w.stages - 1 && w.verbose;
  const int cores = std::max(1, int(std::thread::hardware_concurrency()));
  set_compute_threads(c.run.threads > 0 ? int(c.run.threads) : std::max(1, cores / std::max(1, w.local_world)));
  const torch::Device device = pick_device(c.run.device);

  const Corpus corpus = load_corpus(c.data, c.model.context, out);
  const ModelConfig arch = with_vocabulary(c.model, *corpus.tokenizer);
  if (lead) announce(c, arch, corpus, device, w, out);

  const WindowSampler train_windows(corpus.train, arch.context, c.run.seed);
  const WindowSampler val_windows(corpus.val, arch.context, kEvalSeed);
  const auto model = make_worker_model(c, arch, {train_windows, val_windows, w.replica}, device, w);
  FlatParams flat(model->module());
  InnerOptimizer inner(flat, c.inner);
  const auto outer = make_outer_optimizer(c.outer, c.run.seed, {w.transport, w.membership}, flat);
  const TrainingState state{flat, inner, *outer};
  const FailureDrill drill(c.run.inject_crash, w.rank, w.membership ? w.membership->incarnation() : 0);
  Checkpointer checkpoints(fmt::format("{}/checkpoints/r{}", out, w.rank),
                           c.run.checkpoint_interval > 0 ? c.run.checkpoint_interval : c.eval.interval,
                           c.run.keep_checkpoints, c.inner.steps, arch, out,
                           {{"seed", c.run.seed},
                            {"method", choice_name(c.outer.method)},
                            {"replica", w.replica},
                            {"replicas", w.replicas},
                            {"stage", w.stage},
                            {"stages", w.stages}},
                           state, drill);
  Telemetry telemetry(out, w.rank, c.inner.steps, lead);

  std::optional<Rejoined> rejoined;
  const int64_t first_step = restore(c, w, checkpoints, state, telemetry, lead, rejoined);
  // Only now: a resume refused above leaves the run's config as it was.
  if (w.rank == 0) write_file_atomic(out + "/config.yaml", c.to_yaml());

  const int64_t tokens_per_step = c.inner.batch * c.inner.grad_accum * arch.context;
  const bool across_replicas = w.transport && w.membership && w.replicas > 1;
  uint64_t evaluation_bytes = 0;  // sent for evaluations across replicas, apart from training traffic
  double evaluation_seconds = 0;  // likewise: time to a target loss is training time, the rest is ours
  double val_loss = std::nan(""), last_loss = std::nan("");
  ReplicaSpread spread;
  OuterTally tally;
  Throughput throughput(first_step, c.inner.steps);
  for (int64_t step = first_step; step < c.inner.steps; ++step) {
    drill.before_step(step);
    const double lr = learning_rate(c.inner, step);
    inner.set_lr(lr);
    flat.grads().zero_();
    const StepOutcome outcome = model->train_step(step);
    const double loss = outcome.loss;
    if (model->computes_loss() && outcome.micro_batches > 0 && !std::isfinite(loss))
      throw std::runtime_error(fmt::format("loss became {} at step {} (lower lr?)", loss, step));
    // A pipeline worker whose micro-batches were all dropped (or that sits out
    // the step, restarted and not yet routed to) has nothing to apply.
    double grad_norm = 0;
    if (outcome.micro_batches > 0) {
      outer->on_gradients(flat);
      grad_norm = inner.clip_gradients(c.inner.clip);
      inner.step();
    }
    const int64_t done = step + 1;
    const bool last = done == c.inner.steps;
    const auto outer_start = std::chrono::steady_clock::now();
    std::vector<OuterSync> syncs;
    if (auto sync = outer->after_inner_step(step, flat)) syncs.push_back(std::move(*sync));
    if (last)  // exchanges still in flight (overlap) are applied before the final evaluation
      for (auto& sync : outer->finish(flat)) syncs.push_back(std::move(sync));
    tally.blocked_seconds += seconds_since(outer_start);
    for (const auto& sync : syncs) {
      ++tally.syncs;
      tally.bytes += sync.bytes;
      telemetry.write(record(done, "outer", w,
                             {{"outer_step", sync.outer_step},
                              {"fragment", sync.fragment},
                              {"group", sync.group},
                              {"arrived", sync.arrived},
                              {"bytes", sync.bytes},
                              {"phi_blocks_failed", sync.phi_blocks_failed}}));
    }
    if (!syncs.empty() && w.membership)
      for (int to : serve_rejoins(*w.membership, *w.transport, state, done))
        telemetry.write(record(done, "donate", w, {{"to", to}}));
    if (std::isfinite(loss)) last_loss = loss;
    throughput.step(outcome.micro_batches > 0 ? tokens_per_step : 0, w.link ? w.link->stats().bytes_sent : 0);

    if (done % c.eval.log_interval == 0 || last) {
      auto r = record(done, "train", w, {{"lr", lr}, {"grad_norm", grad_norm}});
      if (w.transport) r["outer_blocked_seconds"] = tally.blocked_seconds;
      if (std::isfinite(loss)) r["loss"] = loss;
      throughput.report(done, r);
      telemetry.write(r);
    }
    if (done % c.eval.interval == 0 || last) {
      const auto evaluation_start = Clock::now();
      val_loss = model->evaluate(done);
      spread = ReplicaSpread{};  // a validation without the spread logs none, not the previous one
      if (across_replicas && (last || c.eval.spread_interval == 0 || done % c.eval.spread_interval == 0)) {
        spread = evaluate_across_replicas(done, *w.transport, *w.membership, flat, *model);
        evaluation_bytes += spread.bytes_sent;
      }
      evaluation_seconds += seconds_since(evaluation_start);
      // So that `report target_loss=` can time runs to a loss.
      auto r = record(done, "val", w,
                      {{"lr", lr}, {"elapsed", seconds_since(start)}, {"evaluation_seconds", evaluation_seconds}});
      if (std::isfinite(val_loss)) r["loss"] = val_loss;
      if (!std::isnan(spread.weight_std)) r["weight_std"] = spread.weight_std;
      if (!std::isnan(spread.weight_std) && w.stages > 1) r["stage_params"] = flat.numel();
      if (!std::isnan(spread.mean_model_loss)) r["loss_mean_model"] = spread.mean_model_loss;
      if (w.transport) r["eval_bytes_sent"] = evaluation_bytes;
      if (w.link) r["eval_activation_bytes_sent"] = w.link->stats().evaluation_bytes_sent;
      telemetry.write(r);
      if (lead && c.eval.sample_tokens > 0 && !last)
        spdlog::info("sample:\n{}", sample_text(*model, *corpus.tokenizer, c.eval, c.run.seed + uint64_t(done)));
    }
    checkpoints.after_step(done);
  }
  if (first_step == c.inner.steps) val_loss = model->evaluate(first_step);  // resumed at the end: report anyway
  if (w.membership) w.membership->finish();

  // Under ddp every step synchronises, all its traffic is that, and it all blocks.
  const bool ddp = c.outer.method == Method::ddp;
  if (ddp) tally = {c.inner.steps - first_step, w.transport->stats().bytes_sent, w.transport->stats().comm_seconds};
  const auto summary = summarize_worker(c, w, arch, *model, flat.numel(), seconds_since(start), val_loss, last_loss,
                                        spread, rejoined, tally);
  const auto j = summary.to_json();
  write_json_atomic(fmt::format("{}/summary_r{}.json", out, w.rank), j);
  if (w.replicas * w.stages == 1) write_json_atomic(out + "/summary.json", summarize_lone_run(summary).to_json());
  if (lead) {
    spdlog::info("done: final val loss {:.4f} (ppl {:.2f}) | {} steps | {} tokens | {} | {} params", val_loss,
                 std::exp(val_loss), c.inner.steps, format_count(double(summary.tokens)),
                 format_duration(summary.seconds), format_count(double(arch.num_params())));
    if (c.eval.sample_tokens > 0)
      spdlog::info("sample:\n{}", sample_text(*model, *corpus.tokenizer, c.eval, c.run.seed + uint64_t(c.inner.steps)));
    spdlog::info("run dir: {}", out);
  }
  return j;
}

}  // namespace noloco
