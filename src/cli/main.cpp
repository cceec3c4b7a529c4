// The noloco command line: a thin layer over train/, model/ and comm/.
#include <signal.h>

#include <algorithm>
#include <csignal>
#include <functional>
#include <cstdlib>
#include <iostream>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <torch/torch.h>

#include "cli/join_command.h"
#include "cli/launch_commands.h"
#include "cli/serve_command.h"
#include "cli/watch_command.h"
#include "config/options.h"
#include "config/train_config.h"
#include "data/prepare.h"
#include "model/generate.h"
#include "sim/simulate.h"
#include "train/bench.h"
#include "train/export.h"
#include "train/report.h"
#include "train/worker_entry.h"
#include "util/error_text.h"
#include "util/human.h"
#include "util/log.h"
#include "util/parse_number.h"
#include "util/process_runtime.h"

using namespace noloco;

namespace {

std::string keys_help() { return "\nConfig keys (YAML or key=value):\n" + config_keys_help(); }

// A subcommand's keys, with their defaults, for its --help.
template <class Args>
std::string keys_help(Options (*options)(Args&)) {
  Args defaults;
  return "\nKeys (key=value):\n" + options(defaults).help();
}

constexpr const char* kReplicaHelp =
    "a run directory's model: mean (the mean of its replicas' weights at their newest common checkpoint, the best "
    "model of a NoLoCo run) or a replica's number";

struct GenerateArgs {
  SamplingOptions sampling;
  std::string prompt = "\n", device = "cpu", replica = kMeanOfReplicas;
};

Options generate_options(GenerateArgs& a) {
  Options options("generate");
  options.add("prompt", a.prompt, "text to continue")
      .add("temperature", a.sampling.temperature, "0: greedy")
      .add("top_k", a.sampling.top_k, "0: whole vocabulary")
      .add("seed", a.sampling.seed, "sampling seed")
      .add("tokens", a.sampling.tokens, "tokens to generate")
      .add("device", a.device, "cpu | cuda | cuda:N")
      .add("replica", a.replica, kReplicaHelp);
  return options;
}

int run_generate(const std::string& checkpoint, const std::vector<std::string>& args) {
  GenerateArgs a;
  generate_options(a).parse(args);
  const auto& o = a.sampling;
  constexpr int64_t kMaxTokens = 1000000;
  if (o.temperature < 0 || o.top_k < 0 || o.tokens < 0 || o.tokens > kMaxTokens)
    throw std::invalid_argument(fmt::format("temperature and top_k must be >= 0, tokens in [0, {}]", kMaxTokens));
  auto trained = load_trained_model(checkpoint, a.replica);
  trained.model->to(torch::Device(a.device));
  const auto ids = generate(trained.model, trained.tokenizer->encode(a.prompt), o);
  std::cout << trained.tokenizer->decode(ids) << std::endl;
  return 0;
}

CLI::App* add_launch_command(CLI::App& app, LaunchArgs& a) {
  auto* cmd = app.add_subcommand("launch", "start N processes of your own program the torchrun way");
  cmd->footer("\n" + wrap_words("", "RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT and the launcher's store, for a "
                                     "PyTorch loop with import noloco: a failed worker does not stop the others; a "
                                     "joined one silent for 30 s is killed."));
  cmd->add_option("workers", a.workers, "how many")->required();
  cmd->add_option("--restarts", a.restarts, "start a failed worker again up to this many times");
  cmd->add_option("--join-dir", a.join_dir, "write join.json and run_token here, for OuterOptimizer(join=DIR)");
  cmd->add_option("command", a.command, "after --: the program and its arguments")->required();
  return cmd;
}

int run_bench(const std::vector<std::string>& args) {
  if (!args.empty() && args[0] == "comm") return bench_comm_command({args.begin() + 1, args.end()});
  reexecute_for_runtime_settings();
  int64_t steps = 10;
  double peak = 0;
  Options options("bench");
  options.add("bench_steps", steps, "timed steps").add("peak_tflops", peak, "peak rate; 0: measure the matmul rate");
  const auto cfg = parse_config("", options.parse_known(args));
  if (steps < 1 || peak < 0) throw std::invalid_argument("bench_steps must be >= 1 and peak_tflops >= 0");
  const auto r = bench_training(cfg, steps, peak);
  fmt::print("bench {} ({} params) on {} in {}: batch {} x {} tokens, {} threads\n", r["model"].get<std::string>(),
             r["params"].get<int64_t>(), r["device"].get<std::string>(), r["precision"].get<std::string>(),
             r["batch"].get<int64_t>(), r["context"].get<int64_t>(), r["threads"].get<int>());
  fmt::print("  {:.0f} tokens/s (forward+backward+AdamW), {:.3f} TFLOP/s, MFU {:.1f}% of {:.2f} TFLOP/s ({})\n",
             r["tokens_per_s"].get<double>(), r["achieved_tflops"].get<double>(), 100 * r["mfu"].get<double>(),
             r["peak_tflops"].get<double>(), r["peak_source"].get<std::string>());
  std::cout << r.dump() << std::endl;
  return 0;
}

struct ExportArgs {
  ExportOptions export_options;
  std::string shard_size = "2GB";
};

Options export_options(ExportArgs& a) {
  Options options("export");
  options.add("shard_size", a.shard_size, "largest weight file, e.g. 2GB, 500MB, 4GiB")
      .add("dtype", a.export_options.dtype, "float32 | bfloat16 | float16")
      .add("replica", a.export_options.replica, kReplicaHelp);
  return options;
}

int run_export(const std::string& checkpoint, const std::string& hf_dir, const std::vector<std::string>& args) {
  ExportArgs a;
  export_options(a).parse(args);
  a.export_options.shard_bytes = parse_byte_size("shard_size", a.shard_size);
  export_hf(checkpoint, hf_dir, a.export_options);
  fmt::print("exported {} ({}) to {}\n", checkpoint,
             a.export_options.replica == kMeanOfReplicas ? "the mean of its replicas"
                                                         : "replica " + a.export_options.replica,
             hf_dir);
  return 0;
}

int run_prepare(const std::vector<std::string>& args) {
  PrepareOptions o;
  o.inputs = prepare_options(o).parse_known(args);
  for (const auto& input : o.inputs)
    if (input.find('=') != std::string::npos)
      throw std::invalid_argument(fmt::format("unknown prepare option '{}'", input));
  const auto r = prepare_corpus(o);
  fmt::print("{}\ntrain on it with: noloco train CONFIG data={} (its val shards and tokenizer come along)\n",
             describe(r), o.out);
  return 0;
}

struct ReportArgs {
  std::string out_dir, throughput;
  double target_loss = 0;
};

Options report_options(ReportArgs& a) {
  Options options("report");
  options.add("out", a.out_dir, "write report.md and plots here")
      .add("target_loss", a.target_loss, "also time each run to its first validation loss at most this (0: off)")
      .add("throughput", a.throughput, "FROM:TO: also tokens/s between these steps, and as a share of the first run's");
  return options;
}

int run_report(const std::vector<std::string>& args) {
  ReportArgs a;
  const auto runs = report_options(a).parse_known(args);
  if (runs.empty()) throw std::invalid_argument("report needs at least one run directory");
  const auto report = report_request(a.target_loss, a.throughput);
  if (a.out_dir.empty()) {
    std::cout << report_tables(runs, report);
  } else {
    std::cout << write_report(runs, a.out_dir, report);
    fmt::print("\nwrote {}/report.md and its plots\n", a.out_dir);
  }
  return 0;
}

int run_simulate(const std::vector<std::string>& args) {
  const auto options = sim::parse_simulate_options(args);
  const auto headline = sim::run_simulation(options);
  fmt::print("{}\nwrote latency.csv, bandwidth.csv, idle.csv, fig5a.svg, fig5b.svg to {}\n", headline.dump(2),
             options.out);
  return 0;
}

// What the command line holds once parsed.
struct Arguments {
  std::string config_path, checkpoint, hf_dir, join_dir;
  std::vector<std::string> overrides, options, runs;
  LaunchArgs launch;
};

// A subcommand and what it runs once parsed (its arguments in Arguments).
struct Command {
  CLI::App* app;
  std::function<int()> run;
  // Computes with LibTorch in this process (train and bench comm, which may
  // only launch workers, decide for themselves).
  bool computes = false;
};

std::vector<Command> add_commands(CLI::App& app, Arguments& a) {
  std::vector<Command> commands;
  auto* train = app.add_subcommand("train", "train a model (CONFIG then key=value overrides)");
  train->add_option("config", a.config_path, "YAML config, e.g. configs/shakespeare.yaml")->required();
  train->add_option("overrides", a.overrides, "key=value overrides");
  train->footer(keys_help());
  commands.push_back({train, [&a] { return train_command(a.config_path, a.overrides); }});

  auto* gen = app.add_subcommand("generate", "sample text from a checkpoint or run directory");
  gen->add_option("checkpoint", a.checkpoint, "checkpoint, run or Hugging Face Llama directory")->required();
  gen->add_option("options", a.options, "key=value (below)");
  gen->footer(keys_help(generate_options));
  commands.push_back({gen, [&a] { return run_generate(a.checkpoint, a.options); }, true});

  auto* exp = app.add_subcommand("export", "write a checkpoint in the Hugging Face Llama layout");
  exp->add_option("checkpoint", a.checkpoint, "checkpoint directory or run directory")->required();
  exp->add_option("hf_dir", a.hf_dir, "output directory")->required();
  exp->add_option("options", a.options, "key=value (below)");
  exp->footer(keys_help(export_options));
  commands.push_back({exp, [&a] { return run_export(a.checkpoint, a.hf_dir, a.options); }, true});

  auto* prepare = app.add_subcommand("prepare", "tokenize text, JSONL, .gz or .zst into train/val token shards");
  prepare->add_option("inputs", a.options, "files or directories, then key=value (below)")->required();
  prepare->footer(keys_help(prepare_options));
  commands.push_back({prepare, [&a] { return run_prepare(a.options); }});

  auto* bench = app.add_subcommand("bench", "training throughput and model-FLOPs utilisation");
  bench->add_option("options", a.options, "config keys, bench_steps=N, peak_tflops=X; or comm ... (below)");
  bench->footer("\n" +
                wrap_words("", "bench comm method=noloco replicas=8 megabytes=3.48 rounds=20 compute=0.05 sigma2=0.5 "
                               "straggler=1 times the methods' own exchanges on model-sized buffers.") +
                keys_help());
  commands.push_back({bench, [&a] { return run_bench(a.options); }});

  auto* sim = app.add_subcommand("simulate", "model sync latency, bandwidth and idle time at up to 1024 replicas");
  sim->add_option("options", a.options, "key=value (below)");
  sim->footer(keys_help(sim::simulate_options));
  commands.push_back({sim, [&a] { return run_simulate(a.options); }});

  auto* report = app.add_subcommand("report", "compare runs: a Markdown table, or with out=DIR a page with plots");
  report->add_option("runs", a.runs, "run directories, then key=value (below)")->required();
  report->footer(keys_help(report_options));
  commands.push_back({report, [&a] { return run_report(a.runs); }});

  auto* join = app.add_subcommand("join", "add a replica to a running noloco run (it takes a live state)");
  join->add_option("run_dir", a.join_dir, "the run's directory (its config.yaml; join.json while it trains here)")
      ->required();
  join->add_option("options", a.options, "key=value (below)");
  join->footer(join_keys_help());
  commands.push_back({join, [&a] { return join_command(a.join_dir, a.options); }, true});

  commands.push_back({add_launch_command(app, a.launch), [&a] { return launch_command(a.launch); }});
  auto* serve = app.add_subcommand("serve", "host a run's store and relay for workers behind NAT (a public machine)");
  serve->add_option("options", a.options, "key=value (below)");
  serve->footer(keys_help(serve_options));
  commands.push_back({serve, [&a] { return serve_command(a.options); }});
  auto* watch = app.add_subcommand("watch", "serve the live page of a run: its members, curves, pairings and timeline");
  watch->add_option("run", a.join_dir, "the run's directory on this machine, or its store's URL (NOLOCO_RUN_TOKEN set)")
      ->required();
  watch->add_option("options", a.options, "key=value: bind=127.0.0.1 port=0 (a free one) wait=60 (seconds for the "
                                          "run's first status) token_file=RUN_DIR/run_token");
  commands.push_back({watch, [&a] { return watch_command(a.join_dir, a.options); }});
  commands.push_back(
      {app.add_subcommand("store-password", "the store's password for NOLOCO_RUN_TOKEN (for an etcd of your own)"),
       store_password_command});
  return commands;
}

size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diagonal = row[0]++;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t above = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] != b[j - 1])});
      diagonal = above;
    }
  }
  return row[b.size()];
}

// What a mistyped command line most likely meant, or "".
std::string usage_hint(const CLI::App& app, int argc, char** argv) {
  const auto commands = app.get_subcommands([](const CLI::App*) { return true; });
  const auto known = [&](const std::string& name) {
    return std::any_of(commands.begin(), commands.end(), [&](const CLI::App* c) { return c->get_name() == name; });
  };
  if (argc > 1 && argv[1][0] != '-' && !known(argv[1])) {
    std::string names, closest;
    size_t best = 3;  // further than two edits is no longer a typo
    for (const auto* command : commands) {
      names += (names.empty() ? "" : ", ") + command->get_name();
      if (const auto d = edit_distance(argv[1], command->get_name()); d < best) {
        best = d;
        closest = command->get_name();
      }
    }
    return fmt::format("noloco: error: unknown command '{}'{}; the commands are {}", argv[1],
                       closest.empty() ? "" : fmt::format(" (did you mean {}?)", closest), names);
  }
  for (int i = 2; i < argc && std::string(argv[i]) != "--"; ++i) {
    const std::string arg = argv[i];
    if (arg.size() > 2 && arg.rfind("--", 0) == 0 && arg != "--help" && arg != "--version") {
      const auto key = arg.substr(2, arg.find('=') - 2);
      return fmt::format("noloco: keys go as key=value, without dashes: {}={}", key,
                         arg.find('=') == std::string::npos ? "..." : arg.substr(arg.find('=') + 1));
    }
  }
  return "";
}

int run_command(int argc, char** argv) {
  // A write to a peer that just died must come back as an error that the
  // exchange handles (average without it), not kill this worker with SIGPIPE.
  ::signal(SIGPIPE, SIG_IGN);
  init_logging("noloco");
  CLI::App app{"noloco: Llama training with NoLoCo, DiLoCo and DDP over c10d"};
  // The LibTorch it was built against: the Python module needs the same torch.
  app.set_version_flag("--version", fmt::format("noloco {} (LibTorch {}.{}.{})", NOLOCO_VERSION, TORCH_VERSION_MAJOR,
                                                  TORCH_VERSION_MINOR, TORCH_VERSION_PATCH));
  app.require_subcommand(1);
  Arguments arguments;
  const auto commands = add_commands(app, arguments);
  if (const auto hint = usage_hint(app, argc, argv); hint.rfind("noloco: error:", 0) == 0) {
    std::cerr << hint << std::endl;
    return 2;
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int code = app.exit(e);
    if (code != 0)
      if (const auto hint = usage_hint(app, argc, argv); !hint.empty()) std::cerr << hint << std::endl;
    return code;
  }
  try {
    for (const auto& command : commands) {
      if (!*command.app) continue;
      if (command.computes) reexecute_for_runtime_settings();
      return command.run();
    }
  } catch (const Interrupted& e) {
    spdlog::error("{}", e.what());
    return 128 + e.signal;
  } catch (const std::exception& e) {
    spdlog::error("{}", error_text(e));
    return 1;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  prepare_process_runtime(argv);
  const int code = run_command(argc, argv);
  // LibTorch's static destructors deregister each of its operators, a tenth of
  // a second a process spent on nothing; what an exit owes is flushed output.
  std::cout.flush();
  spdlog::shutdown();
  std::fflush(nullptr);
  std::_Exit(code);
}
