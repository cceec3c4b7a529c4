#include "cli/launch_commands.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <iostream>
#include <optional>
#include <thread>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "comm/launch/capped_links.h"
#include "comm/launch/launcher.h"
#include "config/options.h"
#include "config/run_layout.h"
#include "config/worker_env.h"
#include "data/dataset.h"
#include "train/bench_comm.h"
#include "train/checkpoint.h"
#include "train/report.h"
#include "train/run_directory.h"
#include "train/run_end.h"
#include "train/run_summary.h"
#include "train/trainer.h"
#include "train/worker_life.h"
#include "train/worker_entry.h"
#include "util/error_text.h"
#include "util/files.h"
#include "util/human.h"
#include "util/log.h"
#include "util/parse_number.h"
#include "util/process_runtime.h"
#include "util/run_files.h"

namespace noloco {

namespace {

// What the launcher's workers run: this command again, with the resolved run directory.
std::vector<std::string> worker_command(std::vector<std::string> command, const std::vector<std::string>& args,
                                        const std::string& out) {
  command.insert(command.end(), args.begin(), args.end());
  command.push_back("out=" + out);
  return command;
}

// The workers of a run directory that hold no complete checkpoint while
// another worker of their stage holds one (say, one killed or out of disk
// while writing its first): a resume starts them from a live replica's state.
std::vector<int> workers_without_checkpoints(const std::string& run_dir, const RunLayout& layout) {
  const int workers = layout.world();
  std::vector<bool> holds(static_cast<size_t>(workers)), stage_holds(static_cast<size_t>(layout.stages()));
  for (int w = 0; w < workers; ++w) {
    holds[size_t(w)] = !complete_checkpoint_steps(run_files::worker_checkpoints(run_dir, w)).empty();
    const auto stage = size_t(layout.stage_of(w));
    stage_holds[stage] = stage_holds[stage] || holds[size_t(w)];
  }
  std::vector<int> out;
  for (int w = 0; w < workers; ++w)
    if (!holds[size_t(w)] && stage_holds[size_t(layout.stage_of(w))]) out.push_back(w);
  return out;
}

// Memory a local worker needs: the runtime, then weights, gradients, AdamW's
// two moments and the outer method's slow weights and momentum (activations
// depend on the batch and are left to the margin of max_local_workers).
int64_t worker_memory_estimate(int64_t params) { return (int64_t(200) << 20) + 24 * params; }

// Each fragment needs at least one of a worker's parameters: checked before
// any worker starts (a pipeline stage holds at least one layer).
void check_fragments(int64_t fragments, const ModelConfig& model, int stages) {
  int64_t smallest = 0;
  for (const auto& [name, shape] : model.parameter_shapes()) {
    if (stages > 1 && name.find("layers.0.") == std::string::npos) continue;
    int64_t n = 1;
    for (const int64_t d : shape) n *= d;
    smallest += n;
  }
  if (fragments > smallest)
    throw std::invalid_argument(fmt::format("fragments={} exceeds the {} parameters a worker {}holds", fragments, smallest,
                                            stages > 1 ? "of a pipeline stage at least " : ""));
}

// The capped network of a local launch with rate=..., or none.
std::unique_ptr<CappedLinks> capped_links(const TrainConfig& cfg, int workers) {
  if (cfg.comm.rate.empty()) return nullptr;
  auto links = std::make_unique<CappedLinks>(workers, parse_bit_rate("rate", cfg.comm.rate));
  spdlog::info("{} workers on links capped at {} each way (network namespaces, launcher at {})", workers,
               cfg.comm.rate, links->host_address());
  return links;
}

// `program` as execvp finds it: the first match on PATH for a bare name.
std::string found_on_path(const std::string& program) {
  if (program.find('/') != std::string::npos) return program;
  const char* path = std::getenv("PATH");
  std::string dirs = path ? path : "";
  for (size_t at = 0; at <= dirs.size();) {
    const size_t end = std::min(dirs.find(':', at), dirs.size());
    const std::string candidate = (end > at ? dirs.substr(at, end - at) : ".") + "/" + program;
    if (::access(candidate.c_str(), X_OK) == 0) return candidate;
    at = end + 1;
  }
  return program;
}

// Why `command`, when it starts a Python interpreter, can't run a loop with
// `import noloco` ("" if it can, or is no Python): the first python3 on PATH
// may be a pyenv shim or a venv without torch, and every worker failing said
// nothing of it. Asked only once all workers failed; bounded by 60 s.
std::string python_without_noloco(const std::vector<std::string>& command) {
  const std::string program = command.front();
  if (std::filesystem::path(program).filename().string().rfind("python", 0) != 0) return "";
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) return "";
  const pid_t pid = ::fork();
  if (pid < 0) {
    ::close(fds[0]);
    ::close(fds[1]);
    return "";
  }
  if (pid == 0) {
    ::dup2(fds[1], 1);
    ::dup2(fds[1], 2);
    ::execlp(program.c_str(), program.c_str(), "-c", "import torch, noloco", static_cast<char*>(nullptr));
    ::_exit(127);
  }
  ::close(fds[1]);
  std::string output;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  for (char buf[4096]; std::chrono::steady_clock::now() < deadline;) {
    pollfd readable{fds[0], POLLIN, 0};
    if (::poll(&readable, 1, 200) <= 0) continue;
    const ssize_t n = ::read(fds[0], buf, sizeof buf);
    if (n <= 0) break;
    output.append(buf, size_t(n));
  }
  ::close(fds[0]);
  int status = 0;
  while (::waitpid(pid, &status, WNOHANG) == 0) {
    if (std::chrono::steady_clock::now() > deadline) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &status, 0);
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  if (WIFEXITED(status) && WEXITSTATUS(status) == 0) return "";
  while (!output.empty() && output.back() == '\n') output.pop_back();
  const auto last_line = output.substr(output.rfind('\n') == std::string::npos ? 0 : output.rfind('\n') + 1);
  return fmt::format("{} ({}) cannot import torch and noloco ({}): run the Python that has both (the one noloco's "
                     "module was built for, with PYTHONPATH naming it)",
                     program, found_on_path(program), last_line.empty() ? "no reason given" : last_line);
}

Options comm_bench_options(CommBenchOptions& o) {
  Options options("bench comm");
  options.add("megabytes", o.megabytes, "fp32 megabytes of the exchanged buffer")
      .add("rounds", o.rounds, "outer steps to time")
      .add("compute", o.compute, "mean seconds of compute before each outer step")
      .add("sigma2", o.sigma2, "variance of the log-normal compute jitter (the paper: 0.5)")
      .add("straggler", o.straggler, "worker 0 computes this many times longer");
  return options;
}

}  // namespace

// One replica, a launched worker (RANK set: our launcher, torchrun, Slurm...),
// or the launcher of `replicas` local workers.
namespace {

// The environment places this process in a run (our launcher's worker,
// torchrun's, a script's): it trains as that worker.
int train_as_worker(TrainConfig& cfg, const WorkerEnv& env) {
  reexecute_for_runtime_settings();
  // Our launcher holds its workers' directory; the workers of a run started otherwise hold it together.
  std::optional<RunDirectory> held;
  if (!launched_by_noloco(env) && !cfg.run.out.empty()) held.emplace(cfg.run.out, cfg, RunDirectory::Hold::worker);
  return run_worker(cfg, env);
}

// Our launcher: the config's workers on this machine (a world of one trains
// here), supervised, and the run's summary from how each ended.
int launch_training(TrainConfig& cfg, const std::string& config_path, const std::vector<std::string>& overrides) {
  const int stages = int(cfg.pipeline.stages);
  cfg.validate_workers();
  const bool trains_here = cfg.outer.method == Method::none && cfg.workers() == 1;
  if (trains_here) reexecute_for_runtime_settings();
  if (cfg.run.out.empty()) cfg.run.out = default_run_dir(cfg);
  const RunDirectory owned(cfg.run.out, cfg);
  if (trains_here) return run_worker(cfg, WorkerEnv{});  // a world of one
  const auto start = std::chrono::steady_clock::now();
  // Builds and saves the tokenizer once, before the workers load it.
  const auto corpus = load_corpus(cfg.data, cfg.model.context, cfg.run.out, cfg.run.resume);
  const auto model = with_vocabulary(cfg.model, *corpus.tokenizer);
  check_local_capacity(cfg.workers(), worker_memory_estimate(model.num_params()), cfg.run.max_local_workers);
  check_fragments(cfg.outer.fragments, model, stages);
  // The last local rank needs a GPU of its own: refused before any worker starts.
  resolved_device(cfg.run.device, int(cfg.workers()) - 1);
  LaunchPlan plan;
  plan.workers = int(cfg.workers());
  plan.stages = stages;
  plan.replica_workers = int(cfg.run.replica_workers);
  plan.method = choice_name(cfg.outer.method);
  plan.comm = cfg.comm;
  plan.keep_going_on_failure = survives_lost_workers(cfg.outer.method, cfg.pipeline.routing, stages);
  const auto links = capped_links(cfg, plan.workers);
  plan.links = links.get();
  // How `noloco join` and `noloco watch` on this machine find the run's store
  // (join refuses a run that takes no joiners). Behind capped links the
  // workers sit in network namespaces a joiner could not reach.
  const bool one_worker_replicas = cfg.run.replica_workers == 1;
  if (!links) plan.join_dir = cfg.run.out;
  if (cfg.run.resume && takes_back_restarted(cfg.outer.method, cfg.pipeline.routing, stages) && one_worker_replicas)
    plan.start_from_peers = workers_without_checkpoints(cfg.run.out, run_layout(cfg));
  if (stages > 1)
    spdlog::info("launching {} replicas x {} stages = {} {} workers, run dir {}", cfg.run.replicas, stages,
                 plan.workers, plan.method, cfg.run.out);
  else if (!one_worker_replicas)
    spdlog::info("launching {} replicas x {} workers = {} {} workers, run dir {}", cfg.run.replicas,
                 cfg.run.replica_workers, plan.workers, plan.method, cfg.run.out);
  else
    spdlog::info("launching {} {} workers, run dir {}", cfg.run.replicas, plan.method, cfg.run.out);
  const auto launched = launch_local_workers(plan, worker_command({"train", config_path}, overrides, cfg.run.out));
  const auto& exits = launched.exits;
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  auto members = exits;
  members.insert(members.end(), launched.joiners.begin(), launched.joiners.end());
  const auto summary = summarize_run(cfg, members, seconds);
  save_run_summary(cfg, summary);
  warn_if_mostly_alone(summary);
  if (launched.signal) throw Interrupted(launched.signal);
  if (!launched.stopped.empty()) throw std::runtime_error(launched.stopped);
  if (!plan.keep_going_on_failure && !summary.failed.empty()) {
    // Name the worker that failed first, not the ones stopped because of it.
    const auto first = std::min_element(exits.begin(), exits.end(), [](const WorkerExit& a, const WorkerExit& b) {
      return !a.ok() && (b.ok() || a.seconds < b.seconds);
    });
    const bool fixed_pipeline = stages > 1 && cfg.pipeline.routing == Routing::fixed;
    throw std::runtime_error(fmt::format(
        "{} run failed: {}{}", plan.method, first->describe(),
        fixed_pipeline ? "; with routing=fixed a pipeline has nowhere else to send a lost worker's micro-batches "
                         "(routing=random goes around it)"
                       : ""));
  }
  if (summary.finished.empty()) throw std::runtime_error("no worker finished; see the messages above");
  std::cout << "\n" << comparison_table({cfg.run.out});
  if (summary.failed.empty()) return 0;
  // The run went on without them: done, but not whole.
  spdlog::warn("finished with {} of {} workers; failed: {}", summary.finished.size(),
               summary.finished.size() + summary.failed.size(),
               [&] {
                 std::string s;
                 for (const auto& f : summary.failed) s += (s.empty() ? "" : "; ") + f.reason;
                 return s;
               }());
  return kFinishedWithLosses;
}

}  // namespace

int train_command(const std::string& config_path, const std::vector<std::string>& overrides) {
  // `noloco train init_from=DIR data=FILE`: keys alone, no config file.
  const bool no_file = config_path.find('=') != std::string::npos && !std::filesystem::exists(config_path);
  auto keys = overrides;
  if (no_file) keys.insert(keys.begin(), config_path);
  auto cfg = load_config(no_file ? "" : config_path, keys);
  WorkerEnv env;
  if (worker_env_from_environment(env)) return train_as_worker(cfg, env);
  return launch_training(cfg, config_path, overrides);
}

// `launch N COMMAND...`: N processes of a program of the user's (a PyTorch
// loop with import noloco) started the torchrun way, with this launcher's
// store and failure policy: a worker that fails does not stop the others
// (torchrun's agent stops them all). Exit codes as `train`'s.
int launch_command(const LaunchArgs& a) {
  const int workers = a.workers;
  LaunchPlan plan;
  if (workers < 1) throw std::invalid_argument(fmt::format("launch: {} workers", workers));
  if (a.restarts < 0) throw std::invalid_argument(fmt::format("launch: --restarts {}", a.restarts));
  if (!a.join_dir.empty() && !std::filesystem::is_directory(a.join_dir))
    throw std::invalid_argument(fmt::format("launch: --join-dir {} is not a directory", a.join_dir));
  check_local_capacity(workers, worker_memory_estimate(0), 0);
  plan.workers = workers;
  plan.method = "launch";
  plan.keep_going_on_failure = true;
  plan.users_program = true;
  plan.comm.restarts = a.restarts;
  plan.join_dir = a.join_dir;
  spdlog::info("launching {} workers: {}", workers, fmt::join(a.command, " "));
  const auto launched = launch_local_workers(plan, a.command);
  if (launched.signal) throw Interrupted(launched.signal);
  // A restarted worker's exit is not a loss: its next start decides.
  int failed = 0, restarted = 0;
  for (const auto& e : launched.exits) {
    if (e.ok()) continue;
    if (e.restarted) {
      ++restarted;
      spdlog::info("{}; started again", e.describe());
      continue;
    }
    ++failed;
    spdlog::warn("{}", e.describe());
  }
  int joiners_failed = 0;
  for (const auto& e : launched.joiners)
    if (!e.ok()) {
      ++joiners_failed;
      spdlog::warn("{}", e.describe());
    }
  if (failed == workers) {
    const auto why = python_without_noloco(a.command);
    throw std::runtime_error(fmt::format("all {} workers failed{}", workers, why.empty() ? "" : ": " + why));
  }
  const auto joiners = launched.joiners.empty() ? std::string()
                                                : fmt::format(" and {} of {} joiners",
                                                              int(launched.joiners.size()) - joiners_failed,
                                                              launched.joiners.size());
  spdlog::info("{} workers{}{} finished", workers - failed, joiners,
               restarted > 0 ? fmt::format(" ({} restarts)", restarted) : "");
  if (failed == 0 && joiners_failed == 0) return 0;
  spdlog::warn("finished without {} of {} workers{}", failed, workers,
               joiners_failed > 0 ? fmt::format(" and {} joiners", joiners_failed) : "");
  return kFinishedWithLosses;
}

// `bench comm ...`: launcher, or (RANK set) one of its workers.
int bench_comm_command(const std::vector<std::string>& args) {
  CommBenchOptions options;
  auto cfg = parse_config("", comm_bench_options(options).parse_known(args));
  validate(options);
  if (cfg.outer.method == Method::none) throw std::invalid_argument("bench comm needs method=ddp, diloco or noloco");
  if (cfg.run.out.empty()) cfg.run.out = "runs/bench_comm";
  WorkerEnv env;
  if (worker_env_from_environment(env)) {
    reexecute_for_runtime_settings();
    const auto worker = start_worker(cfg, {env});
    const auto r = comm_bench_worker(cfg, options, {worker.transport(), worker.membership()});
    write_json_atomic(fmt::format("{}/bench_comm_r{}.json", cfg.run.out, env.rank), r);
    return 0;
  }
  std::filesystem::create_directories(cfg.run.out);
  LaunchPlan plan;
  plan.workers = int(cfg.run.replicas);
  plan.method = choice_name(cfg.outer.method);
  plan.comm = cfg.comm;
  check_local_capacity(plan.workers, worker_memory_estimate(int64_t(options.megabytes * 1e6 / 4)),
                       cfg.run.max_local_workers);
  const auto links = capped_links(cfg, plan.workers);
  plan.links = links.get();
  const auto launched = launch_local_workers(plan, worker_command({"bench", "comm"}, args, cfg.run.out));
  if (launched.signal) throw Interrupted(launched.signal);
  for (auto& e : launched.exits)
    if (!e.ok()) throw std::runtime_error("bench comm failed: " + e.describe());
  const auto s = summarize_comm_bench(cfg, options);
  fmt::print("bench comm {} x{} ({} MB, {}, {} rounds, compute {}s, sigma2 {}, straggler x{}, {}): sync {:.4f}s/round{}, "
             "idle {:.4f}s/round, median idle of workers 1..N-1 {:.4f}s/round\n",
             plan.method, cfg.run.replicas, options.megabytes, choice_name(cfg.outer.wire_dtype), options.rounds,
             options.compute, options.sigma2, options.straggler,
             cfg.comm.rate.empty() ? "loopback" : "links at " + cfg.comm.rate,
             s["sync_seconds_per_round"].get<double>(),
             cfg.comm.rate.empty() ? ""
                                   : fmt::format(" (ideal {:.4f}s: {:.2f}x)", s["ideal_sync_seconds"].get<double>(),
                                                 s["sync_seconds_per_round"].get<double>() /
                                                     s["ideal_sync_seconds"].get<double>()),
             s["idle_seconds_per_round"].get<double>(), s["median_idle_seconds_others"].get<double>());
  if (options.compute > 0)
    fmt::print("pace={}: the replicas did {:.1f}% of the inner steps their own speeds allow\n",
               choice_name(cfg.outer.pace), 100 * s["work_fraction"].get<double>());
  return 0;
}

}  // namespace noloco
