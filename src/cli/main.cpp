// The noloco command line: a thin layer over train/, model/ and comm/.
#include <csignal>
#include <iostream>
#include <map>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/torch.h>

#include "data/tokenizer.h"
#include "model/generate.h"
#include "model/llama.h"
#include "train/bench.h"
#include "train/checkpoint.h"
#include "train/config.h"
#include "train/export.h"
#include "train/trainer.h"
#include "train/run_summary.h"
#include "train/report.h"
#include "sim/simulate.h"
#include "comm/activation_link.h"
#include "comm/gloo_communicator.h"
#include "comm/heartbeat.h"
#include "comm/launcher.h"
#include "comm/bench_comm.h"
#include "data/dataset.h"
#include "util/files.h"
#include "util/parse_number.h"

#include <chrono>
#include <filesystem>

using namespace noloco;

namespace {

std::string keys_help() {
  std::string s = "\nConfig keys (YAML or key=value):\n";
  for (auto& k : config_keys()) s += fmt::format("  {:<20} {}\n", k.name, k.help);
  return s;
}

// key=value arguments of the commands that are not configs.
std::map<std::string, std::string> parse_pairs(const std::vector<std::string>& args,
                                               const std::vector<std::string>& allowed) {
  std::map<std::string, std::string> out;
  for (auto& a : args) {
    const auto eq = a.find('=');
    const auto key = eq == std::string::npos ? a : a.substr(0, eq);
    if (eq == std::string::npos || std::find(allowed.begin(), allowed.end(), key) == allowed.end())
      throw std::invalid_argument(fmt::format("unexpected argument '{}' (allowed: {}=...)", a, fmt::join(allowed, "=..., ")));
    out[key] = a.substr(eq + 1);
  }
  return out;
}

int run_generate(const std::string& checkpoint, const std::vector<std::string>& args) {
  auto kv = parse_pairs(args, {"prompt", "temperature", "top_k", "seed", "tokens", "device"});
  const auto cfg = parse_config("", {});
  const auto path = find_checkpoint(checkpoint);
  if (path.empty()) throw std::runtime_error(fmt::format("no checkpoint found at '{}'", checkpoint));
  auto ckpt = read_whole_model(path);
  auto tokenizer = load_tokenizer(path);
  SamplingOptions o;
  auto number = [&](const char* key, double fallback) {
    auto it = kv.find(key);
    return it == kv.end() ? fallback : parse_non_negative(key, it->second);
  };
  o.temperature = number("temperature", o.temperature);
  o.top_k = int64_t(number("top_k", double(o.top_k)));
  o.seed = uint64_t(number("seed", 0));
  o.tokens = int64_t(number("tokens", double(o.tokens)));
  torch::Device device(kv.count("device") ? kv["device"] : cfg.device);
  LlamaForCausalLM model(ckpt.model);
  {
    torch::NoGradGuard no_grad;
    for (auto& p : model->named_parameters()) p.value().copy_(ckpt.weights.at(p.key()));
  }
  model->to(device);
  const auto prompt = tokenizer->encode(kv.count("prompt") ? kv["prompt"] : "\n");
  const auto ids = generate(model, prompt, o);
  std::cout << tokenizer->decode(ids) << std::endl;
  return 0;
}

std::string error_prefix = "noloco: error: ";

// The connections of a worker of a launched run.
struct WorkerLinks {
  c10::intrusive_ptr<c10d::Store> store;
  std::unique_ptr<Heartbeat> heartbeat;
  std::unique_ptr<GlooCommunicator> comm;  // among the replicas of this worker's stage
  std::unique_ptr<ActivationLink> link;    // to the other stages, with a pipeline
};

// Joins the run this process was launched into; errors now name the worker.
WorkerLinks join_as_worker(const WorkerEnv& env, const TrainConfig& cfg) {
  error_prefix = fmt::format("noloco[worker {}]: error: ", env.rank);
  const auto timeout = std::chrono::milliseconds(int64_t(cfg.peer_timeout * 1000));
  const int stages = int(cfg.stages), stage = env.rank % stages;
  WorkerLinks links;
  links.store = connect_store(env, timeout);
  links.heartbeat = std::make_unique<Heartbeat>(env);
  if (cfg.method != "none") {
    const auto group = stages > 1 ? fmt::format("stage{}", stage) : std::string("replicas");
    links.comm = std::make_unique<GlooCommunicator>(
        links.store, env, group, env.rank / stages, env.world / stages, cfg.bind, timeout,
        std::chrono::milliseconds(int64_t(cfg.heartbeat_timeout * 1000)));
  }
  if (stages > 1) links.link = std::make_unique<ActivationLink>(links.store, env, cfg.bind, timeout);
  return links;
}

// What the launcher's workers run: this command again, with the resolved run directory.
std::vector<std::string> worker_command(std::vector<std::string> command, const std::vector<std::string>& args,
                                        const std::string& out) {
  command.insert(command.end(), args.begin(), args.end());
  command.push_back("out=" + out);
  return command;
}

// One replica, a launched worker (RANK set: our launcher, torchrun, Slurm...),
// or the launcher of `replicas` local workers.
int run_train(const std::string& config_path, const std::vector<std::string>& overrides) {
  auto cfg = load_config(config_path, overrides);
  WorkerEnv env;
  if (worker_env_from_environment(env)) {
    if (env.world % cfg.stages != 0)
      throw std::invalid_argument(fmt::format("WORLD_SIZE={} is not a multiple of stages={}", env.world, cfg.stages));
    cfg.replicas = env.world / cfg.stages;
    cfg.validate();
    if (cfg.out.empty()) throw std::invalid_argument("launched workers need out=DIR, the same for all of them");
    const auto links = join_as_worker(env, cfg);
    WorkerInfo w;
    w.rank = env.rank;
    w.stages = int(cfg.stages);
    w.stage = env.rank % w.stages;
    w.replica = env.rank / w.stages;
    w.replicas = int(cfg.replicas);
    const char* local = std::getenv("LOCAL_WORLD_SIZE");
    w.local_world = local ? std::max(1, std::atoi(local)) : 1;
    w.comm = links.comm.get();
    w.link = links.link.get();
    train(cfg, w);
    return 0;
  }
  if (cfg.method == "none" && cfg.stages == 1) {
    train(cfg, WorkerInfo{});
    return 0;
  }
  const auto start = std::chrono::steady_clock::now();
  if (cfg.out.empty()) cfg.out = default_run_dir(cfg);
  std::filesystem::create_directories(cfg.out);
  load_corpus(cfg, cfg.out);  // builds and saves the tokenizer once, before the workers load it
  write_file_atomic(cfg.out + "/config.yaml", cfg.to_yaml());
  const auto worker_args = worker_command({"train", config_path}, overrides, cfg.out);
  // A lost stage stalls every pipeline that routes through it, so only
  // unpipelined NoLoCo carries on without a worker.
  const bool survives_failures = cfg.method == "noloco" && cfg.stages == 1;
  if (cfg.stages > 1)
    fmt::print("noloco: launching {} replicas x {} stages = {} {} workers, run dir {}\n", cfg.replicas, cfg.stages,
               cfg.replicas * cfg.stages, cfg.method, cfg.out);
  else
    fmt::print("noloco: launching {} {} workers, run dir {}\n", cfg.replicas, cfg.method, cfg.out);
  std::fflush(stdout);
  const auto exits = launch_local_workers(cfg, worker_args, /*keep_going_on_failure=*/survives_failures);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const auto summary = summarize_run(cfg.out, cfg, exits, seconds);
  write_json_atomic(cfg.out + "/summary.json", summary);
  if (!survives_failures && !summary["replicas_failed"].empty()) {
    // Name the worker that failed first, not the ones stopped because of it.
    const auto first = std::min_element(exits.begin(), exits.end(), [](const WorkerExit& a, const WorkerExit& b) {
      return !a.ok() && (b.ok() || a.seconds < b.seconds);
    });
    throw std::runtime_error(fmt::format("{} run failed: {}", cfg.method, first->describe()));
  }
  if (summary["replicas_finished"].empty()) throw std::runtime_error("no worker finished; see the messages above");
  fmt::print("\n{}", comparison_table({cfg.out}));
  for (auto& f : summary["replicas_failed"]) fmt::print("failed: {}\n", f["reason"].get<std::string>());
  return 0;
}

// `bench comm ...`: launcher, or (RANK set) one of its workers.
int run_comm_bench(std::vector<std::string> args) {
  const std::vector<std::string> original = args;
  const auto options = parse_comm_bench_options(args);
  auto cfg = parse_config("", args);
  if (cfg.method == "none") throw std::invalid_argument("bench comm needs method=ddp, diloco or noloco");
  if (cfg.out.empty()) cfg.out = "runs/bench_comm";
  WorkerEnv env;
  if (worker_env_from_environment(env)) {
    const auto links = join_as_worker(env, cfg);
    const auto r = comm_bench_worker(cfg, options, *links.comm);
    write_json_atomic(fmt::format("{}/bench_comm_r{}.json", cfg.out, env.rank), r);
    return 0;
  }
  std::filesystem::create_directories(cfg.out);
  const auto exits =
      launch_local_workers(cfg, worker_command({"bench", "comm"}, original, cfg.out), /*keep_going_on_failure=*/false);
  for (auto& e : exits)
    if (!e.ok()) throw std::runtime_error("bench comm failed: " + e.describe());
  const auto s = summarize_comm_bench(cfg, options);
  fmt::print("bench comm {} x{} ({} MB, {} rounds, compute {}s, sigma2 {}, straggler x{}): sync {:.4f}s/round, idle "
             "{:.4f}s/round, median idle of workers 1..N-1 {:.4f}s/round\n",
             cfg.method, cfg.replicas, options.megabytes, options.rounds, options.compute, options.sigma2,
             options.straggler, s["sync_seconds_per_round"].get<double>(), s["idle_seconds_per_round"].get<double>(),
             s["median_idle_seconds_others"].get<double>());
  return 0;
}

int run_bench(const std::vector<std::string>& args) {
  if (!args.empty() && args[0] == "comm") return run_comm_bench({args.begin() + 1, args.end()});
  std::vector<std::string> overrides;
  int64_t steps = 10;
  double peak = 0;
  for (auto& a : args) {
    if (a.rfind("bench_steps=", 0) == 0) {
      steps = parse_integer("bench_steps", a.substr(12));
    } else if (a.rfind("peak_tflops=", 0) == 0) {
      peak = parse_non_negative("peak_tflops", a.substr(12));
    } else {
      overrides.push_back(a);
    }
  }
  const auto cfg = parse_config("", overrides);
  const auto r = bench_training(cfg, steps, peak);
  fmt::print("bench {} ({} params) on {} in {}: batch {} x {} tokens, {} threads\n", r["model"].get<std::string>(),
             r["params"].get<int64_t>(), r["device"].get<std::string>(), r["precision"].get<std::string>(), r["batch"].get<int64_t>(),
             r["context"].get<int64_t>(), r["threads"].get<int>());
  fmt::print("  {:.0f} tokens/s (forward+backward+AdamW), {:.3f} TFLOP/s, MFU {:.1f}% of {:.2f} TFLOP/s ({})\n",
             r["tokens_per_s"].get<double>(), r["achieved_tflops"].get<double>(), 100 * r["mfu"].get<double>(),
             r["peak_tflops"].get<double>(), r["peak_source"].get<std::string>());
  std::cout << r.dump() << std::endl;
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  // A write to a peer that just died must come back as an error that the
  // exchange handles (average without it), not kill this worker with SIGPIPE.
  ::signal(SIGPIPE, SIG_IGN);
  CLI::App app{"noloco: Llama training with NoLoCo, DiLoCo and DDP over c10d"};
  app.require_subcommand(1);

  std::string config_path;
  std::vector<std::string> overrides;
  auto* train_cmd = app.add_subcommand("train", "train a model (CONFIG then key=value overrides)");
  train_cmd->add_option("config", config_path, "YAML config, e.g. configs/shakespeare.yaml")->required();
  train_cmd->add_option("overrides", overrides, "key=value overrides");
  train_cmd->footer(keys_help());

  std::string checkpoint;
  std::vector<std::string> gen_args;
  auto* gen_cmd = app.add_subcommand("generate", "sample text from a checkpoint or run directory");
  gen_cmd->add_option("checkpoint", checkpoint, "checkpoint directory or run directory")->required();
  gen_cmd->add_option("options", gen_args, "prompt=... temperature=0.8 top_k=40 seed=0 tokens=200 device=cpu");

  std::string hf_dir;
  auto* export_cmd = app.add_subcommand("export", "write a checkpoint in the Hugging Face Llama layout");
  export_cmd->add_option("checkpoint", checkpoint, "checkpoint directory or run directory")->required();
  export_cmd->add_option("hf_dir", hf_dir, "output directory")->required();

  std::vector<std::string> bench_args;
  auto* bench_cmd = app.add_subcommand("bench", "training throughput and model-FLOPs utilisation");
  bench_cmd->add_option("options", bench_args, "config keys (model=125m batch=4 ...), bench_steps=N, peak_tflops=X; or: comm method=noloco "
                      "replicas=8 megabytes=3.48 rounds=20 compute=0.05 sigma2=0.5");
  bench_cmd->footer(keys_help());

  std::vector<std::string> sim_args;
  auto* sim_cmd = app.add_subcommand("simulate", "model sync latency, bandwidth and idle time at up to 1024 replicas");
  sim_cmd->add_option("options", sim_args,
                      "out=DIR samples=2000 outer_steps=100 max_replicas=1024 model=125m step_seconds=0.5 seed=1");

  std::vector<std::string> report_runs;
  auto* report_cmd = app.add_subcommand("report", "compare runs: a Markdown table, or with out=DIR a page with plots");
  report_cmd->add_option("runs", report_runs, "run directories, then optionally out=DIR")->required();

  CLI11_PARSE(app, argc, argv);
  try {
    if (*train_cmd) {
      return run_train(config_path, overrides);
    }
    if (*gen_cmd) return run_generate(checkpoint, gen_args);
    if (*export_cmd) {
      export_hf(checkpoint, hf_dir);
      fmt::print("exported {} to {}\n", checkpoint, hf_dir);
      return 0;
    }
    if (*bench_cmd) return run_bench(bench_args);
    if (*sim_cmd) {
      const auto options = sim::parse_simulate_options(sim_args);
      const auto headline = sim::run_simulation(options);
      fmt::print("{}\nwrote latency.csv, bandwidth.csv, idle.csv, fig5a.svg, fig5b.svg to {}\n", headline.dump(2),
                 options.out);
      return 0;
    }
    if (*report_cmd) {
      std::vector<std::string> runs;
      std::string out_dir;
      for (auto& r : report_runs) {
        if (r.rfind("out=", 0) == 0) {
          out_dir = r.substr(4);
        } else {
          runs.push_back(r);
        }
      }
      if (runs.empty()) throw std::invalid_argument("report needs at least one run directory");
      if (out_dir.empty()) {
        std::cout << comparison_table(runs);
      } else {
        std::cout << write_report(runs, out_dir);
        fmt::print("\nwrote {}/report.md and its plots\n", out_dir);
      }
      return 0;
    }
  } catch (const std::exception& e) {
    // LibTorch's errors carry a backtrace after the message: keep the one line.
    const auto* torch_error = dynamic_cast<const c10::Error*>(&e);
    const std::string msg = torch_error ? torch_error->what_without_backtrace() : e.what();
    std::cerr << error_prefix << msg.substr(0, msg.find('\n')) << std::endl;
    return 1;
  }
  return 0;
}
