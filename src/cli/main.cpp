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
#include <torch/version.h>

#include "cli/join_command.h"
#include "cli/keys_help.h"
#include "cli/launch_commands.h"
#include "cli/serve_command.h"
#include "cli/tool_commands.h"
#include "cli/watch_command.h"
#include "config/train_config.h"
#include "train/worker_entry.h"
#include "util/error_text.h"
#include "util/human.h"
#include "util/log.h"
#include "util/process_runtime.h"

using namespace noloco;

namespace {

std::string keys_help() { return "\nConfig keys (YAML or key=value):\n" + config_keys_help(); }

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
  train->add_option("config", a.config_path, "YAML config, e.g. configs/shakespeare.yaml, or the first key=value (no config file)")->required();
  train->add_option("overrides", a.overrides, "key=value overrides");
  train->footer(keys_help());
  commands.push_back({train, [&a] { return train_command(a.config_path, a.overrides); }});

  auto* gen = app.add_subcommand("generate", "sample text from a checkpoint or run directory");
  gen->add_option("checkpoint", a.checkpoint, "checkpoint, run or Hugging Face Llama directory")->required();
  gen->add_option("options", a.options, "key=value (below)");
  gen->footer(generate_keys_help());
  commands.push_back({gen, [&a] { return generate_command(a.checkpoint, a.options); }, true});

  auto* exp = app.add_subcommand("export", "write a checkpoint in the Hugging Face Llama layout");
  exp->add_option("checkpoint", a.checkpoint, "checkpoint directory or run directory")->required();
  exp->add_option("hf_dir", a.hf_dir, "output directory")->required();
  exp->add_option("options", a.options, "key=value (below)");
  exp->footer(export_keys_help());
  commands.push_back({exp, [&a] { return export_command(a.checkpoint, a.hf_dir, a.options); }, true});

  auto* prepare = app.add_subcommand("prepare", "tokenize text, JSONL, .gz or .zst into train/val token shards");
  prepare->add_option("inputs", a.options, "files or directories, then key=value (below)")->required();
  prepare->footer(prepare_keys_help());
  commands.push_back({prepare, [&a] { return prepare_command(a.options); }});

  auto* bench = app.add_subcommand("bench", "training throughput and model-FLOPs utilisation");
  bench->add_option("options", a.options, "config keys, bench_steps=N, peak_tflops=X; or comm ... (below)");
  bench->footer("\n" +
                wrap_words("", "bench comm method=noloco replicas=8 megabytes=3.48 rounds=20 compute=0.05 sigma2=0.5 "
                               "straggler=1 times the methods' own exchanges on model-sized buffers.") +
                keys_help());
  commands.push_back({bench, [&a] { return bench_command(a.options); }});

  auto* sim = app.add_subcommand("simulate", "model sync latency, bandwidth and idle time at up to 1024 replicas");
  sim->add_option("options", a.options, "key=value (below)");
  sim->footer(simulate_keys_help());
  commands.push_back({sim, [&a] { return simulate_command(a.options); }});

  auto* report = app.add_subcommand("report", "compare runs: a Markdown table, or with out=DIR a page with plots");
  report->add_option("runs", a.runs, "run directories, then key=value (below)")->required();
  report->footer(report_keys_help());
  commands.push_back({report, [&a] { return report_command(a.runs); }});

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
  watch->add_option("run", a.join_dir,
                    "the run's directory on this machine, or its store's URL (NOLOCO_RUN_TOKEN set); "
                    "default: NOLOCO_STORE, as `serve` printed");
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
