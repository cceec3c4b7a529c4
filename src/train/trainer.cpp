#include "train/trainer.h"

#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <ctime>
#include <filesystem>
#include <thread>

#include <fmt/format.h>

#include "comm/activation_link.h"
#include "data/dataset.h"
#include "model/generate.h"
#include "model/llama.h"
#include "optim/flat_params.h"
#include "optim/inner.h"
#include "optim/outer.h"
#include "pipeline/stage.h"
#include "train/checkpoint.h"
#include "train/forward_backward.h"
#include "train/metrics.h"
#include "train/peer_state.h"
#include "util/compute_threads.h"
#include "util/files.h"
#include "util/tensorboard.h"

namespace noloco {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

namespace {

// Validation windows are the same for every run, so runs can be compared.
constexpr uint64_t kEvalSeed = 0x5eedba11;

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

torch::Device pick_device(const std::string& name) {
  torch::Device d(name);
  if (d.is_cuda() && !torch::cuda::is_available())
    throw std::runtime_error(fmt::format("device={} but no CUDA device is available to LibTorch", name));
  return d;
}

nlohmann::json comm_json(const CommStats& s) {
  return {{"bytes_sent", s.bytes_sent},     {"bytes_received", s.bytes_received},
          {"comm_seconds", s.comm_seconds}, {"wait_seconds", s.wait_seconds},
          {"collectives", s.collectives},   {"messages", s.messages}};
}

// Which worker a record comes from, and its traffic so far: weights (outer
// method) and, in a pipeline, activations.
nlohmann::json worker_json(const WorkerInfo& w) {
  nlohmann::json j = {{"replica", w.replica}};
  if (w.comm) j.update(comm_json(w.comm->stats()));
  if (w.link) {
    const auto& p = w.link->stats();
    j.update({{"worker", w.rank},
              {"stage", w.stage},
              {"activation_bytes_sent", p.bytes_sent},
              {"activation_bytes_received", p.bytes_received},
              {"pipeline_idle_seconds", p.idle_seconds}});
  }
  return j;
}

}  // namespace

std::string default_run_dir(const TrainConfig& c) {
  std::time_t now = std::time(nullptr);
  char stamp[32];
  std::strftime(stamp, sizeof stamp, "%Y%m%d-%H%M%S", std::localtime(&now));
  return fmt::format("runs/{}-{}", c.method == "none" ? "single" : c.method, stamp);
}

nlohmann::json train(const TrainConfig& c, const WorkerInfo& w) {
  const auto start = Clock::now();
  const std::string out = c.out.empty() ? default_run_dir(c) : c.out;
  fs::create_directories(out);
  // The worker that prints: replica 0's, on the stage that sees the loss.
  const bool lead = w.replica == 0 && w.stage == w.stages - 1 && w.verbose;
  const int cores = std::max(1, int(std::thread::hardware_concurrency()));
  set_compute_threads(c.threads > 0 ? int(c.threads) : std::max(1, cores / std::max(1, w.local_world)));
  const torch::Device device = pick_device(c.device);

  Corpus corpus = load_corpus(c, out);
  ModelConfig arch = c.arch;
  arch.vocab_size = corpus.tokenizer->vocab_size();
  if (w.rank == 0) write_file_atomic(out + "/config.yaml", c.to_yaml());
  if (lead) {
    fmt::print("noloco: {} model, {} parameters, {} training FLOPs/token, vocab {} ({}), {} train / {} val tokens\n",
               c.model, format_count(double(arch.num_params())), format_count(arch.train_flops_per_token()),
               arch.vocab_size, corpus.tokenizer->kind(), format_count(double(corpus.train.numel())),
               format_count(double(corpus.val.numel())));
    fmt::print("noloco: method {}, {} replica(s), device {}, {} threads, run dir {}\n", c.method, w.replicas,
               device.str(), torch::get_num_threads(), out);
    if (w.stages > 1)
      fmt::print("noloco: {} pipeline stages, {} routing, {} micro-batches per step (GPipe)\n", w.stages, c.routing,
                 c.grad_accum);
  }

  const WindowSampler train_windows(corpus.train, arch.context, c.seed);
  const WindowSampler val_windows(corpus.val, arch.context, kEvalSeed);
  const StepData data{train_windows, val_windows, w.replica};
  const auto worker_model =
      w.stages > 1 ? make_pipeline_stage(c, arch, data, device, {w.replica, w.replicas, w.stage, w.stages}, *w.link)
                   : make_whole_model(c, arch, data, device);
  FlatParams flat(worker_model->module());
  InnerOptimizer inner(flat, c);
  auto outer = make_outer_optimizer(c, w.comm, flat);

  const std::string ckpt_dir = fmt::format("{}/checkpoints/r{}", out, w.rank);
  int64_t first_step = 0;
  if (c.resume) {
    const auto path = find_checkpoint(ckpt_dir);
    if (path.empty()) {
      if (lead) fmt::print("noloco: resume=true but {} holds no checkpoint; starting from scratch\n", ckpt_dir);
    } else {
      auto ckpt = read_checkpoint(path, /*with_state=*/true);
      if (ckpt.model.to_json() != arch.to_json())
        throw std::runtime_error(fmt::format("{}: checkpoint model {} does not match the config {}", path,
                                             ckpt.model.to_json().dump(), arch.to_json().dump()));
      torch::NoGradGuard no_grad;
      for (auto& [name, t] : flat.named()) {
        const auto it = ckpt.weights.find(name);
        if (it == ckpt.weights.end())
          throw std::runtime_error(fmt::format("{}: checkpoint lacks {} (another stage's checkpoint?)", path, name));
        t.copy_(it->second);
      }
      first_step = ckpt.info.at("step").get<int64_t>();
      inner.load(ckpt.state, ckpt.info.at("adam_steps").get<int64_t>());
      outer->load(ckpt.state);
      if (lead) fmt::print("noloco: resumed from {} at step {}\n", path, first_step);
    }
  }

  MetricsLog metrics(out + "/metrics.jsonl");
  // A restarted NoLoCo worker takes its state from a live replica, not from disk.
  nlohmann::json rejoined;
  if (w.comm && w.comm->incarnation() > 0) {
    if (c.method != "noloco")
      throw std::runtime_error(fmt::format("worker {} was restarted, but only a noloco run can take it back", w.rank));
    const auto t0 = Clock::now();
    const auto got = w.comm->receive_state(training_state_numel(flat, *outer));
    unpack_training_state(got.values, got.adam_steps, flat, inner, *outer);
    first_step = got.step;
    rejoined = {{"rejoined_at_step", first_step}, {"rejoin_donor", got.donor}, {"rejoin_seconds", seconds_since(t0)}};
    metrics.write({{"step", first_step}, {"split", "rejoin"}, {"replica", w.replica}, {"donor", got.donor},
                   {"seconds", seconds_since(t0)}});
    fmt::print("noloco[worker {}]: restarted (incarnation {}); took replica {}'s state at step {} in {:.1f}s\n", w.rank,
               w.comm->incarnation(), got.donor, first_step, seconds_since(t0));
    std::fflush(stdout);
  }
  // One event file per replica: `tensorboard --logdir runs/` shows each as a run.
  EventWriter tensorboard(fmt::format("{}/tensorboard/replica_{}", out, w.rank), fmt::format("r{}", w.rank));
  const int64_t tokens_per_step = c.batch * c.grad_accum * arch.context;

  auto evaluate = [&] { return worker_model->evaluate(); };
  // The paper's Fig. 3B: spread of weights across replicas, and the loss of their
  // average. An evaluation-only exchange, charged apart from training traffic;
  // if a replica is gone it is skipped rather than failing the run. With a
  // pipeline, per stage (the spread over all weights is combined in summary.json).
  uint64_t evaluation_bytes = 0;  // sent for these evaluations, apart from training traffic
  auto evaluate_across_replicas = [&](int64_t step) -> std::pair<double, double> {
    if (!w.comm || w.replicas < 2) return {std::nan(""), std::nan("")};
    torch::NoGradGuard no_grad;
    auto& theta = flat.values();
    try {
      const auto group = w.comm->live_group(step);
      if (!group || group->world() < 2) return {std::nan(""), std::nan("")};
      auto mean = theta.clone();
      group->all_reduce_mean(mean);
      auto var = (theta - mean).square();
      group->all_reduce_mean(var);
      evaluation_bytes += group->stats().bytes_sent;
      const double std_dev = var.mean().sqrt().item<double>();
      double mean_loss = std::nan("");
      // The first live replica (in a pipeline: replica 0, on every stage) evaluates the mean model.
      if (group->rank() == 0) {
        auto own = theta.clone();
        theta.copy_(mean);
        mean_loss = evaluate();
        theta.copy_(own);
      }
      return {mean_loss, std_dev};
    } catch (const std::exception& e) {
      if (lead) fmt::print("noloco: mean-model evaluation skipped: {}\n", std::string(e.what()).substr(0, 200));
      return {std::nan(""), std::nan("")};
    }
  };
  auto sample_text = [&](int64_t step) -> std::string {
    auto* model = worker_model->whole_model();
    if (!model) return "(no samples from a pipelined run; export it and use `noloco generate`)";
    SamplingOptions o;
    o.tokens = c.sample_tokens;
    o.seed = c.seed + uint64_t(step);
    std::vector<int32_t> prompt;
    try {
      prompt = corpus.tokenizer->encode(c.sample_prompt);
    } catch (const std::invalid_argument&) {
      prompt.clear();  // a prompt outside the vocabulary: start from token 0
    }
    const auto ids = generate(*model, prompt, o);
    return corpus.tokenizer->decode(std::vector<int32_t>(ids.begin() + long(prompt.size()), ids.end()));
  };
  int64_t crash_step = -1, crash_checkpoint = -1, freeze_step = -1;
  using Mode = TrainConfig::CrashPoint::Mode;
  for (const auto& point : c.crash_plan())
    if (point.rank == w.rank && (!w.comm || w.comm->incarnation() == 0))  // a restarted worker runs on
      (point.mode == Mode::kill ? crash_step : point.mode == Mode::freeze ? freeze_step : crash_checkpoint) = point.step;
  auto checkpoint = [&](int64_t steps_done) {
    Checkpoint ck;
    ck.model = arch;
    for (auto& [name, t] : flat.named()) ck.weights[name] = t;
    inner.save(ck.state);
    outer->save(ck.state);
    ck.info = {{"step", steps_done},          {"adam_steps", inner.steps_taken()},
               {"seed", c.seed},              {"method", c.method},
               {"replica", w.replica},        {"replicas", w.replicas},
               {"stage", w.stage},            {"stages", w.stages}};
    write_checkpoint(ckpt_dir, steps_done, ck, out, [&] {
      if (steps_done == crash_checkpoint) ::raise(SIGKILL);
    });
  };

  double val_loss = std::nan(""), mean_model_loss = std::nan(""), weight_std = std::nan("");
  double last_loss = std::nan("");
  auto window_start = Clock::now();
  int64_t window_tokens = 0, window_steps = 0;
  uint64_t window_activation_bytes = 0;
  const auto loop_start = Clock::now();
  for (int64_t step = first_step; step < c.steps; ++step) {
    if (step == crash_step) ::raise(SIGKILL);
    if (step == freeze_step) ::raise(SIGSTOP);
    const double lr = learning_rate(c, step);
    inner.set_lr(lr);
    flat.grads().zero_();
    const double loss_sum = worker_model->train_step(step);
    if (worker_model->computes_loss() && !std::isfinite(loss_sum))
      throw std::runtime_error(fmt::format("loss became {} at step {} (lower lr?)", loss_sum, step));
    outer->on_gradients(flat);
    const double grad_norm = inner.clip_gradients(c.clip);
    inner.step();
    const auto sync = outer->after_inner_step(step, flat);
    if (sync) {
      nlohmann::json rec = {{"step", step + 1}, {"split", "outer"}, {"outer_step", sync->outer_step},
                            {"group", sync->group}, {"arrived", sync->arrived}};
      rec.update(worker_json(w));
      metrics.write(rec);
      const auto pack = [&] { return pack_training_state(flat, inner, *outer); };
      for (int r : w.comm->serve_rejoins(step + 1, inner.steps_taken(), pack))
        metrics.write({{"step", step + 1}, {"split", "donate"}, {"replica", w.replica}, {"to", r}});
    }
    last_loss = loss_sum;
    window_tokens += tokens_per_step;
    window_steps += 1;

    const int64_t done = step + 1;
    const bool last = done == c.steps;
    if (done % c.log_interval == 0 || last) {
      const double dt = seconds_since(window_start);
      const double tps = double(window_tokens) / std::max(dt, 1e-9);
      const double elapsed = seconds_since(loop_start);
      const double eta = elapsed / double(done - first_step) * double(c.steps - done);
      nlohmann::json rec = {{"step", done},         {"split", "train"},      {"lr", lr},
                            {"tokens_per_s", tps}, {"grad_norm", grad_norm}, {"elapsed", elapsed}};
      rec.update(worker_json(w));
      if (worker_model->computes_loss()) {
        rec["loss"] = loss_sum;
        tensorboard.scalar("train/loss", done, loss_sum);
      }
      if (w.link) {
        const auto& p = w.link->stats();
        rec["activation_bytes_per_step"] = double(p.bytes_sent - window_activation_bytes) / double(window_steps);
        tensorboard.scalar("pipeline/activation_bytes_sent", done, double(p.bytes_sent));
        tensorboard.scalar("pipeline/idle_seconds", done, p.idle_seconds);
        window_activation_bytes = p.bytes_sent;
      }
      metrics.write(rec);
      tensorboard.scalar("train/lr", done, lr);
      tensorboard.scalar("train/tokens_per_s", done, tps);
      if (w.comm) {
        tensorboard.scalar("comm/bytes_sent", done, double(w.comm->stats().bytes_sent));
        tensorboard.scalar("comm/seconds", done, w.comm->stats().comm_seconds);
        tensorboard.scalar("comm/wait_seconds", done, w.comm->stats().wait_seconds);
      }
      tensorboard.flush();
      if (lead) {
        fmt::print("step {:>6}/{} | loss {:.4f} | lr {:.2e} | {} tok/s | {} elapsed | eta {}", done, c.steps,
                   loss_sum, lr, format_count(tps), format_duration(elapsed), format_duration(eta));
        if (w.comm)
          fmt::print(" | sent {}B | comm {:.1f}s (wait {:.1f}s)", format_count(double(w.comm->stats().bytes_sent)),
                     w.comm->stats().comm_seconds, w.comm->stats().wait_seconds);
        if (w.link)
          fmt::print(" | activations {}B | pipeline idle {:.1f}s", format_count(double(w.link->stats().bytes_sent)),
                     w.link->stats().idle_seconds);
        fmt::print("\n");
      }
      std::fflush(stdout);
      window_start = Clock::now();
      window_tokens = 0;
      window_steps = 0;
    }
    if (done % c.eval_interval == 0 || last) {
      val_loss = evaluate();
      std::tie(mean_model_loss, weight_std) = evaluate_across_replicas(done);
      nlohmann::json rec = {{"step", done}, {"split", "val"}, {"lr", lr}};
      rec.update(worker_json(w));
      if (worker_model->computes_loss()) rec["loss"] = val_loss;
      if (!std::isnan(weight_std)) rec["weight_std"] = weight_std;
      if (!std::isnan(weight_std) && w.stages > 1) rec["stage_params"] = flat.numel();
      if (!std::isnan(mean_model_loss)) rec["loss_mean_model"] = mean_model_loss;
      if (w.comm) rec["eval_bytes_sent"] = evaluation_bytes;
      if (w.link) rec["eval_activation_bytes_sent"] = w.link->stats().evaluation_bytes_sent;
      metrics.write(rec);
      if (worker_model->computes_loss()) tensorboard.scalar("val/loss", done, val_loss);
      if (!std::isnan(weight_std)) tensorboard.scalar("val/weight_std_across_replicas", done, weight_std);
      if (!std::isnan(mean_model_loss)) tensorboard.scalar("val/loss_mean_of_replicas", done, mean_model_loss);
      tensorboard.flush();
      if (lead) {
        fmt::print("eval step {} | val loss {:.4f} | ppl {:.2f}", done, val_loss, std::exp(val_loss));
        if (!std::isnan(weight_std))
          fmt::print(" | mean-of-replicas val loss {:.4f} | weight std {:.3e}", mean_model_loss, weight_std);
        fmt::print("\n");
        if (c.sample_tokens > 0 && !last) fmt::print("--- sample ---\n{}\n--------------\n", sample_text(done));
        std::fflush(stdout);
      }
    }
    const int64_t ckpt_every = c.checkpoint_interval > 0 ? c.checkpoint_interval : c.eval_interval;
    if (done % ckpt_every == 0 || last) checkpoint(done);
  }
  if (first_step == c.steps) val_loss = evaluate();  // resumed at the end: report anyway
  if (w.comm) w.comm->finish();

  const double seconds = seconds_since(start);
  nlohmann::json summary = {{"method", c.method},
                            {"replicas", w.replicas},
                            {"steps", c.steps},
                            {"tokens", tokens_per_step * c.steps},
                            {"seconds", seconds},
                            {"params", arch.num_params()},
                            {"device", device.str()}};
  summary.update(worker_json(w));
  if (worker_model->computes_loss()) {
    summary["final_val_loss"] = val_loss;
    summary["final_train_loss"] = last_loss;
  }
  if (w.stages > 1) {
    summary.update({{"stages", w.stages}, {"routing", c.routing}, {"stage_params", flat.numel()}});
  }
  if (!std::isnan(weight_std)) summary["weight_std"] = weight_std;
  if (!std::isnan(mean_model_loss)) summary["final_val_loss_mean_model"] = mean_model_loss;
  if (!rejoined.is_null()) summary.update(rejoined);
  write_json_atomic(fmt::format("{}/summary_r{}.json", out, w.rank), summary);
  if (w.replicas * w.stages == 1) write_json_atomic(out + "/summary.json", summary);
  if (lead) {
    fmt::print("\ndone: final val loss {:.4f} (ppl {:.2f}) | {} steps | {} tokens | {} | {} params\n", val_loss,
               std::exp(val_loss), c.steps, format_count(double(tokens_per_step * c.steps)),
               format_duration(seconds), format_count(double(arch.num_params())));
    if (c.sample_tokens > 0) fmt::print("--- sample ---\n{}\n--------------\n", sample_text(c.steps));
    fmt::print("run dir: {}\n", out);
  }
  return summary;
}

}  // namespace noloco
