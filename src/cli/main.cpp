// The noloco command line: a thin layer over train/, model/ and comm/.
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>

#include <atomic>
#include <cstdio>
#include <csignal>
#include <cstdlib>
#include <optional>
#include <iostream>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <torch/torch.h>

#include "comm/launch/capped_links.h"
#include "comm/launch/launcher.h"
#include "comm/membership/membership.h"
#include "comm/store/store.h"
#include "comm/store/run_keys.h"
#include "comm/launch/worker_connections.h"
#include "config/options.h"
#include "config/train_config.h"
#include "config/worker_env.h"
#include "data/dataset.h"
#include "data/prepare.h"
#include "data/tokenizer.h"
#include "model/generate.h"
#include "model/hf_directory.h"
#include "model/llama.h"
#include "sim/simulate.h"
#include "train/bench.h"
#include "train/bench_comm.h"
#include "train/checkpoint.h"
#include "train/export.h"
#include "train/failure_drill.h"
#include "train/report.h"
#include "train/run_directory.h"
#include "train/run_summary.h"
#include "train/trainer.h"
#include "util/files.h"
#include "pipeline/activation_channel.h"
#include "util/human.h"
#include "util/error_text.h"
#include "util/leave_signal.h"
#include "util/log.h"
#include "util/process_runtime.h"
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

int run_generate(const std::string& checkpoint, const std::vector<std::string>& args) {
  SamplingOptions o;
  std::string prompt = "\n", device = "cpu";
  Options options("generate");
  options.add("prompt", prompt, "text to continue")
      .add("temperature", o.temperature, "0: greedy")
      .add("top_k", o.top_k, "0: whole vocabulary")
      .add("seed", o.seed, "sampling seed")
      .add("tokens", o.tokens, "tokens to generate")
      .add("device", device, "cpu | cuda | cuda:N");
  options.parse(args);
  constexpr int64_t kMaxTokens = 1000000;
  if (o.temperature < 0 || o.top_k < 0 || o.tokens < 0 || o.tokens > kMaxTokens)
    throw std::invalid_argument(fmt::format("temperature and top_k must be >= 0, tokens in [0, {}]", kMaxTokens));
  const auto path = find_checkpoint(checkpoint);
  const bool hf = path.empty() && is_hf_directory(checkpoint);
  if (path.empty() && !hf)
    throw std::runtime_error(fmt::format("no checkpoint or Hugging Face directory found at '{}'", checkpoint));
  std::optional<Checkpoint> ckpt;
  if (!hf) ckpt = read_whole_model(path);
  const auto tokenizer = load_tokenizer(hf ? checkpoint : path);
  LlamaForCausalLM model(hf ? read_hf_config(checkpoint) : ckpt->model);
  if (hf) {
    load_hf_weights(model, checkpoint);
  } else {
    torch::NoGradGuard no_grad;
    for (auto& p : model->named_parameters()) p.value().copy_(ckpt->weights.at(p.key()));
  }
  model->to(torch::Device(device));
  const auto ids = generate(model, tokenizer->encode(prompt), o);
  std::cout << tokenizer->decode(ids) << std::endl;
  return 0;
}

// What the launcher's workers run: this command again, with the resolved run directory.
std::vector<std::string> worker_command(std::vector<std::string> command, const std::vector<std::string>& args,
                                        const std::string& out) {
  command.insert(command.end(), args.begin(), args.end());
  command.push_back("out=" + out);
  return command;
}

WorkerInfo worker_info(const WorkerEnv& env, int stages, int replica_workers, const WorkerConnections& links) {
  WorkerInfo w;
  w.rank = env.rank;
  w.stages = stages;
  w.stage = env.rank % stages;
  w.replica_workers = replica_workers;
  w.replica_worker = env.rank % replica_workers;
  w.replica = env.rank / (stages * replica_workers);
  w.replicas = env.world / (stages * replica_workers);
  w.replica_group = links.replica_group.get();
  w.from_live_state = env.restart > 0;
  w.local_rank = env.local_rank;
  w.local_world = env.local_world;
  w.transport = links.transport.get();
  w.membership = links.membership.get();
  w.link = links.link.get();
  const auto timeout = std::max(std::chrono::milliseconds(600000), links.timeout);
  w.agree_resume_step = [store = links.store, env, stages, timeout](const std::vector<int64_t>& steps) {
    return agree_resume_step(store, env.token, env.rank, env.world, stages, steps, timeout);
  };
  return w;
}

// The workers of a run directory that hold no complete checkpoint while
// another worker of their stage holds one (say, one killed or out of disk
// while writing its first): a resume starts them from a live replica's state.
std::vector<int> workers_without_checkpoints(const std::string& run_dir, int workers, int stages) {
  std::vector<bool> holds(static_cast<size_t>(workers)), stage_holds(static_cast<size_t>(stages));
  for (int w = 0; w < workers; ++w) {
    holds[size_t(w)] = !complete_checkpoint_steps(fmt::format("{}/checkpoints/r{}", run_dir, w)).empty();
    stage_holds[size_t(w % stages)] = stage_holds[size_t(w % stages)] || holds[size_t(w)];
  }
  std::vector<int> out;
  for (int w = 0; w < workers; ++w)
    if (!holds[size_t(w)] && stage_holds[size_t(w % stages)]) out.push_back(w);
  return out;
}

// Exit status of a run that finished without some of its workers (NoLoCo goes on without them).
constexpr int kFinishedWithLosses = 3;

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

// A run whose replicas trained apart finishes with exit code 0: say so.
void warn_if_mostly_alone(const RunSummary& summary) {
  if (summary.replicas_mostly_alone.empty()) return;
  spdlog::warn("{} {} exchanged with no partner at more than {:.0f}% of {} outer steps (worst: paired at {:.0f}%, "
               "{:.0f} outer steps alone in a row): the replicas drifted apart; see summary.json",
               summary.stages > 1 ? "workers" : "replicas", fmt::join(summary.replicas_mostly_alone, ", "),
               100 * kMostlyAlone, summary.replicas_mostly_alone.size() > 1 ? "their" : "its",
               100 * summary.paired_fraction_worst.value_or(0.0), summary.longest_alone_outer_steps.value_or(0.0));
}

// A worker launched into a run (RANK set: our launcher, torchrun, Slurm...).
int run_launched_worker(TrainConfig& cfg, const WorkerEnv& env, int stages) {
  init_logging(fmt::format("noloco[worker {}]", env.rank));
  const int per_replica = stages * int(cfg.run.replica_workers);
  if (env.world % per_replica != 0)
    throw std::invalid_argument(fmt::format("WORLD_SIZE={} is not a multiple of the {} workers a replica has "
                                            "(stages={}, replica_workers={})",
                                            env.world, per_replica, stages, cfg.run.replica_workers));
  cfg.run.replicas = env.world / per_replica;
  cfg.validate();
  cfg.validate_workers();
  if (cfg.run.out.empty()) throw std::invalid_argument("launched workers need out=DIR, the same for all of them");
  // A first start only: a restarted worker is past its drill. (Not yet
  // joined, it cannot ask the store which start this is; the launcher
  // tells a restart by its environment.)
  if (env.restart == 0) FailureDrill(cfg.run.inject_crash, env.rank, 0).at_startup();
  const bool can_leave = takes_joiners(cfg.outer.method, cfg.pipeline.routing, stages) && cfg.run.replica_workers == 1;
  if (can_leave) leave_on_sigterm();
  const auto links =
      join_as_worker(env, cfg.comm, stages, cfg.outer.method != Method::none, int(cfg.run.replica_workers),
                     uses_nccl(cfg.run.device, cfg.comm) ? resolved_device(cfg.run.device, env.local_rank) : "");
  auto info = worker_info(env, stages, int(cfg.run.replica_workers), links);
  if (can_leave) info.leave_requested = leave_requested;
  train(cfg, info);
  outlast_store_users(links);
  return 0;
}

// One replica, a launched worker (RANK set: our launcher, torchrun, Slurm...),
// or the launcher of `replicas` local workers.
int run_train(const std::string& config_path, const std::vector<std::string>& overrides) {
  auto cfg = load_config(config_path, overrides);
  const int stages = int(cfg.pipeline.stages);
  WorkerEnv env;
  if (worker_env_from_environment(env)) return run_launched_worker(cfg, env, stages);
  cfg.validate_workers();
  if (cfg.run.out.empty()) cfg.run.out = default_run_dir(cfg);
  const RunDirectory owned(cfg.run.out, cfg);
  if (cfg.outer.method == Method::none && cfg.workers() == 1) {
    train(cfg, WorkerInfo{});
    return 0;
  }
  const auto start = std::chrono::steady_clock::now();
  // Builds and saves the tokenizer once, before the workers load it.
  const auto corpus = load_corpus(cfg.data, cfg.model.context, cfg.run.out);
  const auto model = with_vocabulary(cfg.model, *corpus.tokenizer);
  check_local_capacity(cfg.workers(), worker_memory_estimate(model.num_params()), cfg.run.max_local_workers);
  check_fragments(cfg.outer.fragments, model, stages);
  // The last local rank needs a GPU of its own: refused before any worker starts.
  resolved_device(cfg.run.device, int(cfg.workers()) - 1);
  write_file_atomic(cfg.run.out + "/config.yaml", cfg.to_yaml());
  LaunchPlan plan;
  plan.workers = int(cfg.workers());
  plan.stages = stages;
  plan.replica_workers = int(cfg.run.replica_workers);
  plan.method = choice_name(cfg.outer.method);
  plan.comm = cfg.comm;
  plan.keep_going_on_failure = survives_lost_workers(cfg.outer.method, cfg.pipeline.routing, stages);
  const auto links = capped_links(cfg, plan.workers);
  plan.links = links.get();
  // Behind capped links the workers sit in network namespaces a joiner could not reach.
  const bool one_worker_replicas = cfg.run.replica_workers == 1;
  if (takes_joiners(cfg.outer.method, cfg.pipeline.routing, stages) && !links)
    plan.join_dir = cfg.run.out;
  if (cfg.run.resume && takes_back_restarted(cfg.outer.method, cfg.pipeline.routing, stages) && one_worker_replicas)
    plan.start_from_peers = workers_without_checkpoints(cfg.run.out, plan.workers, stages);
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
  auto summary = summarize_run(cfg.run.out, cfg.outer.method, cfg.run.replicas, stages, choice_name(cfg.pipeline.routing),
                               cfg.inner.grad_accum, members, seconds, cfg.run.replica_workers);
  summary.activation_codec = choice_name(cfg.pipeline.activation_codec);
  summary.activation_grad_codec = choice_name(cfg.pipeline.activation_grad_codec);
  const auto codecs = activation_codecs(cfg);  // rotation applies to integer codes only
  summary.activation_rotation = codecs.activations.rotate || codecs.gradients.rotate;
  summary.activation_subspace = cfg.pipeline.activation_subspace;
  if (stages > 1) {  // over the hidden-state values a step's boundaries carry, both directions
    const double boundary_values = double(cfg.run.replicas * (stages - 1) * 2 * cfg.inner.grad_accum *
                                          cfg.inner.batch * cfg.model.context * cfg.model.hidden);
    summary.activation_bits_per_value = summary.activation_bytes_per_step * 8 / boundary_values;
  }
  // A resume that every worker refused leaves the summary of the run it resumed.
  if (!summary.finished.empty() || !cfg.run.resume || !file_exists(cfg.run.out + "/summary.json"))
    write_json_atomic(cfg.run.out + "/summary.json", summary.to_json());
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

constexpr std::chrono::milliseconds kJoinFirstContact{10000};

// A joining replica of several workers: its first worker claims the member
// id and starts the others with this variable ("member:worker"), the same
// command otherwise.
constexpr const char* kJoiningReplicaWorker = "NOLOCO_JOINING_REPLICA_WORKER";

struct JoinerPlace {
  int member = 0;
  int replica_worker = 0;  // its place in a replica of several workers
  int stage = 0;
};

// Where a joiner trains: claimed from the run's store, or, for the other
// workers of a joining replica, the place its first worker claimed.
JoinerPlace joiner_place(const WorkerEnv& env, const TrainConfig& cfg, int64_t stage) {
  const int stages = int(cfg.pipeline.stages);
  if (const char* given = std::getenv(kJoiningReplicaWorker)) {
    JoinerPlace p;
    if (std::sscanf(given, "%d:%d", &p.member, &p.replica_worker) != 2 || p.replica_worker <= 0 ||
        p.replica_worker >= cfg.run.replica_workers || p.member < cfg.run.replicas)
      throw std::invalid_argument(fmt::format("{}='{}' is not a place in a joining replica", kJoiningReplicaWorker, given));
    return p;
  }
  const auto timeout = std::chrono::milliseconds(int64_t(cfg.comm.peer_timeout * 1000));
  // The first contact is bounded on its own: a store that does not answer
  // would otherwise hold a new user silent for twice peer_timeout.
  const auto first_contact = std::min(timeout, kJoinFirstContact);
  spdlog::info("join: reaching the run's store at {} (up to {} s)", env.store_url, first_contact.count() / 1000);
  try {
    const auto run_store = connect_store(env, first_contact);
    if (stage < 0) stage = least_served_stage(run_store, env.token, stages, int(cfg.run.replicas));
    // Laid out replica-major like the launched workers: member m of stage s is worker m·stages + s.
    return {claim_member_id(run_store, env.token, replica_scope(stages, int(stage)), int(cfg.run.replicas)), 0,
            int(stage)};
  } catch (const std::runtime_error& e) {
    throw std::runtime_error(fmt::format("join: could not use the run's store at {} (first contact, {} s): {}",
                                         env.store_url, first_contact.count() / 1000, e.what()));
  }
}

// The first worker of a joining replica of several starts the others, which
// take the state it takes; they end with it (SIGTERM when it exits).
std::vector<pid_t> start_replica_workers(const JoinerPlace& place, int replica_workers, const WorkerEnv& env,
                                         const std::string& run_dir, const std::vector<std::string>& args) {
  std::vector<pid_t> others;
  if (place.replica_worker != 0) return others;
  std::vector<std::string> command{"join", run_dir};
  command.insert(command.end(), args.begin(), args.end());
  for (int k = 1; k < replica_workers; ++k)
    others.push_back(start_noloco_process(
        command, {fmt::format("{}={}:{}", kJoiningReplicaWorker, place.member, k), "NOLOCO_RUN_TOKEN=" + env.token}));
  return others;
}

// Waits for the replica's other workers; throws naming those that failed.
void await_replica_workers(const std::vector<pid_t>& others) {
  int failed = 0;
  for (const pid_t pid : others) {
    int status = 0;
    failed += ::waitpid(pid, &status, 0) != pid || !WIFEXITED(status) || WEXITSTATUS(status) != 0;
  }
  if (failed > 0)
    throw std::runtime_error(fmt::format("join: {} of the replica's other {} workers failed", failed, others.size()));
}

// `join RUN_DIR`: a new NoLoCo replica of the run training into RUN_DIR (of
// one pipeline stage, in a pipelined run; of replica_workers workers, each a
// process of this machine, where the run's replicas have several). It claims
// the next member id from the run's store, takes a live replica's state at
// that replica's next outer step and trains with the others to the end (or,
// a replica of one worker, until SIGTERM).
int run_join(const std::string& run_dir, const std::vector<std::string>& args) {
  std::string store, token_file = run_dir + "/run_token";
  int64_t stage = -1;
  Options options("join");
  options.add("store", store, "the run's store (NOLOCO_STORE's form); default: the one in RUN_DIR/join.json")
      .add("token_file", token_file, "where the token is when NOLOCO_RUN_TOKEN is unset")
      .add("stage", stage, "pipelined run: the stage to serve; default: the one with the fewest live workers");
  auto overrides = options.parse_known(args);
  // Everything else is the run's: a joiner with its own steps or model would
  // train apart from the run while the launcher waited for it.
  for (const auto& o : overrides) {
    const auto key = o.substr(0, o.find('='));
    if (key != "device" && key != "threads" && key != "bind" && key != "inject_crash")
      throw std::invalid_argument(fmt::format("join: {} is the run's (its config.yaml); a joiner sets only device, "
                                              "threads, bind and inject_crash",
                                              key));
  }
  int local_workers = 1;  // workers sharing this machine's cores
  if (store.empty()) {
    const auto invitation = read_join_invitation(run_dir);
    store = invitation.store;
    local_workers = invitation.workers + 1;
  }
  overrides.push_back("out=" + run_dir);
  auto cfg = load_config(run_dir + "/config.yaml", overrides);
  const int stages = int(cfg.pipeline.stages), replica_workers = int(cfg.run.replica_workers);
  if (!takes_joiners(cfg.outer.method, cfg.pipeline.routing, stages))
    throw std::invalid_argument(fmt::format(
        "join: the run in {} is {}{}; only a noloco run (pipelined: with routing=random) takes joiners", run_dir,
        choice_name(cfg.outer.method),
        stages > 1 ? fmt::format(" with {} pipeline stages, routing={}", stages, choice_name(cfg.pipeline.routing))
                   : ""));
  if (stage >= stages || stage < -1)
    throw std::invalid_argument(fmt::format("join: stage={} is not a stage of the run (0..{})", stage, stages - 1));
  cfg.validate();
  cfg.validate_workers();
  WorkerEnv env;
  env.world = int(cfg.workers());
  env.local_world = local_workers + replica_workers - 1;
  env.agent_store = true;
  env.token = joiner_token(token_file);
  env.store_url = store;
  pin_hosted_store_key(env);
  const auto place = joiner_place(env, cfg, stage);
  env.rank = (place.member * replica_workers + place.replica_worker) * stages + place.stage;
  env.local_rank = place.replica_worker;
  init_logging(fmt::format("noloco[worker {}]", env.rank));
  if (stages > 1)
    spdlog::info("joining the run in {} as worker {}: stage {} of replica {}", run_dir, env.rank, place.stage,
                 place.member);
  else if (replica_workers > 1 && place.replica_worker == 0)
    spdlog::info("joining the run in {} as replica {} of {} workers (this is its first)", run_dir, place.member,
                 replica_workers);
  else if (place.replica_worker == 0)
    spdlog::info("joining the run in {} as replica {}", run_dir, env.rank);
  FailureDrill(cfg.run.inject_crash, env.rank, 0).at_startup();
  // A replica of several workers leaves whole or not at all: SIGTERM ends it.
  if (replica_workers == 1) leave_on_sigterm();
  const auto others = start_replica_workers(place, replica_workers, env, run_dir, args);
  const auto links = join_as_worker(env, cfg.comm, stages, true, replica_workers,
                                    uses_nccl(cfg.run.device, cfg.comm) ? resolved_device(cfg.run.device, env.local_rank) : "");
  auto info = worker_info(env, stages, replica_workers, links);
  info.agree_resume_step = nullptr;  // it starts from a live replica's state, never from the disk
  info.from_live_state = true;
  if (replica_workers == 1) info.leave_requested = leave_requested;
  train(cfg, info);
  await_replica_workers(others);
  return 0;
}

// `launch N [--restarts K] [--join-dir DIR] -- PROGRAM ARGS`.
struct LaunchArgs {
  int workers = 0;
  std::vector<std::string> command;
  int64_t restarts = 0;
  std::string join_dir;
};

CLI::App* add_launch_command(CLI::App& app, LaunchArgs& a) {
  auto* cmd = app.add_subcommand(
      "launch", "start N processes of your own program the torchrun way (RANK, WORLD_SIZE, ...; a PyTorch loop with "
                "import noloco): a failed worker does not stop the others; a joined one silent for 30 s is killed");
  cmd->add_option("workers", a.workers, "how many")->required();
  cmd->add_option("--restarts", a.restarts,
                  "start a failed worker again up to this many times (it takes a live replica's state)");
  cmd->add_option("--join-dir", a.join_dir,
                  "while the run is on, write join.json and run_token here, for OuterOptimizer(join=DIR)");
  cmd->add_option("command", a.command, "after --: the program and its arguments")->required();
  return cmd;
}

// `launch N COMMAND...`: N processes of a program of the user's (a PyTorch
// loop with import noloco) started the torchrun way, with this launcher's
// store and failure policy: a worker that fails does not stop the others
// (torchrun's agent stops them all). Exit codes as `train`'s.
int run_launch(const LaunchArgs& a) {
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
  if (failed == workers) throw std::runtime_error(fmt::format("all {} workers failed", workers));
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
int run_comm_bench(const std::vector<std::string>& args) {
  CommBenchOptions options;
  auto cfg = parse_config("", comm_bench_options(options).parse_known(args));
  validate(options);
  if (cfg.outer.method == Method::none) throw std::invalid_argument("bench comm needs method=ddp, diloco or noloco");
  if (cfg.run.out.empty()) cfg.run.out = "runs/bench_comm";
  WorkerEnv env;
  if (worker_env_from_environment(env)) {
    init_logging(fmt::format("noloco[worker {}]", env.rank));
    const auto links = join_as_worker(env, cfg.comm, 1, true);
    const auto r = comm_bench_worker(cfg, options, {links.transport.get(), links.membership.get()});
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
  return 0;
}

int run_bench(const std::vector<std::string>& args) {
  if (!args.empty() && args[0] == "comm") return run_comm_bench({args.begin() + 1, args.end()});
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

int run_export(const std::string& checkpoint, const std::string& hf_dir, const std::vector<std::string>& args) {
  ExportOptions o;
  std::string shard_size = "2GB";
  Options options("export");
  options.add("shard_size", shard_size, "largest weight file, e.g. 2GB, 500MB, 4GiB")
      .add("dtype", o.dtype, "float32 | bfloat16 | float16");
  options.parse(args);
  o.shard_bytes = parse_byte_size("shard_size", shard_size);
  export_hf(checkpoint, hf_dir, o);
  fmt::print("exported {} to {}\n", checkpoint, hf_dir);
  return 0;
}

int run_prepare(const std::vector<std::string>& args) {
  PrepareOptions o;
  Options options("prepare");
  options.add("out", o.out, "output directory: train_*.bin and val_*.bin shards and the tokenizer")
      .add("tokenizer", o.tokenizer, "bpe (trained on the inputs) | a sentencepiece .model | a directory holding one")
      .add("vocab_size", o.vocab_size, "BPE vocabulary to train")
      .add("val_fraction", o.val_fraction, "held out for validation (the tail of every chunk)")
      .add("text_field", o.text_field, "the field of a .jsonl line that holds its document")
      .add("shard_tokens", o.shard_tokens, "tokens a shard (llm.c's fineweb: 100M)");
  o.inputs = options.parse_known(args);
  for (const auto& input : o.inputs)
    if (input.find('=') != std::string::npos)
      throw std::invalid_argument(fmt::format("unknown prepare option '{}'", input));
  const auto r = prepare_corpus(o);
  fmt::print("{} file(s) of {:.1f} MB, {} documents of {:.1f} MB of text -> {} train tokens in {} shard(s), {} val "
             "tokens in {} (vocabulary {}) in {}; tokenized at {:.2f} MB/s of files, {:.2f} MB/s of text\n",
             r.files, double(r.bytes) / 1e6, r.documents, double(r.text_bytes) / 1e6,
             format_count(double(r.train_tokens)), r.train_shards, format_count(double(r.val_tokens)), r.val_shards,
             r.vocab_size, format_duration(r.seconds), double(r.bytes) / 1e6 / std::max(r.tokenize_seconds, 1e-9),
             double(r.text_bytes) / 1e6 / std::max(r.tokenize_seconds, 1e-9));
  fmt::print("train on it with: noloco train CONFIG data={} (its val shards and tokenizer come along)\n", o.out);
  return 0;
}

int run_report(const std::vector<std::string>& args) {
  std::string out_dir, throughput;
  double target_loss = 0;
  Options options("report");
  options.add("out", out_dir, "write report.md and plots here")
      .add("target_loss", target_loss, "also time each run to its first validation loss at most this (0: off)")
      .add("throughput", throughput, "FROM:TO: also tokens/s between these steps, and as a share of the first run's");
  const auto runs = options.parse_known(args);
  if (runs.empty()) throw std::invalid_argument("report needs at least one run directory");
  if (target_loss < 0) throw std::invalid_argument("report needs target_loss >= 0");
  ReportOptions report;
  if (target_loss > 0) report.target_loss = target_loss;
  if (!throughput.empty()) {
    const auto colon = throughput.find(':');
    const auto bad = std::invalid_argument(
        fmt::format("report throughput wants two steps FROM:TO with 0 <= FROM < TO, got '{}'", throughput));
    if (colon == std::string::npos) throw bad;
    int64_t from = -1, to = -1;
    try {
      from = parse_integer("throughput", throughput.substr(0, colon));
      to = parse_integer("throughput", throughput.substr(colon + 1));
    } catch (const std::invalid_argument&) {
      throw bad;
    }
    if (from < 0 || to <= from) throw bad;
    report.throughput_steps = std::pair{from, to};
  }
  if (out_dir.empty()) {
    std::cout << report_tables(runs, report);
  } else {
    std::cout << write_report(runs, out_dir, report);
    fmt::print("\nwrote {}/report.md and its plots\n", out_dir);
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

}  // namespace

int main(int argc, char** argv) {
  prepare_process_runtime(argv);
  // A write to a peer that just died must come back as an error that the
  // exchange handles (average without it), not kill this worker with SIGPIPE.
  ::signal(SIGPIPE, SIG_IGN);
  init_logging("noloco");
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
  gen_cmd->add_option("checkpoint", checkpoint, "checkpoint, run or Hugging Face Llama directory")->required();
  gen_cmd->add_option("options", gen_args, "prompt=... temperature=0.8 top_k=40 seed=0 tokens=200 device=cpu");

  std::string hf_dir;
  std::vector<std::string> export_args;
  auto* export_cmd = app.add_subcommand("export", "write a checkpoint in the Hugging Face Llama layout");
  export_cmd->add_option("checkpoint", checkpoint, "checkpoint directory or run directory")->required();
  export_cmd->add_option("hf_dir", hf_dir, "output directory")->required();
  export_cmd->add_option("options", export_args, "shard_size=2GB dtype=float32|bfloat16|float16");

  std::vector<std::string> prepare_args;
  auto* prepare_cmd = app.add_subcommand("prepare", "tokenize text, JSONL, .gz or .zst files or directories into train/val token shards");
  prepare_cmd->add_option("inputs", prepare_args,
                          "files or directories, then out=DIR tokenizer=bpe|FILE.model|DIR vocab_size=8192 "
                          "val_fraction=0.01")
      ->required();

  std::vector<std::string> bench_args;
  auto* bench_cmd = app.add_subcommand("bench", "training throughput and model-FLOPs utilisation");
  bench_cmd->add_option("options", bench_args,
                        "config keys (model=125m batch=4 ...), bench_steps=N, peak_tflops=X; or: comm method=noloco "
                        "replicas=8 megabytes=3.48 rounds=20 compute=0.05 sigma2=0.5 straggler=1");
  bench_cmd->footer(keys_help());

  std::vector<std::string> sim_args;
  auto* sim_cmd = app.add_subcommand("simulate", "model sync latency, bandwidth and idle time at up to 1024 replicas");
  sim_cmd->add_option("options", sim_args,
                      "out=DIR samples=2000 outer_steps=100 max_replicas=1024 model=125m step_seconds=0.5 seed=1");

  std::vector<std::string> report_args;
  auto* report_cmd = app.add_subcommand("report", "compare runs: a Markdown table, or with out=DIR a page with plots");
  report_cmd->add_option("runs", report_args, "run directories, then optionally out=DIR")->required();

  std::string join_dir;
  std::vector<std::string> join_args;
  auto* join_cmd = app.add_subcommand(
      "join", "add a replica (a stage worker, pipelined) to a running noloco run (it takes a live replica's state)");
  join_cmd->add_option("run_dir", join_dir, "the run's directory (its config.yaml; join.json while it trains here)")
      ->required();
  join_cmd->add_option("options", join_args,
                       "store=URL (another machine's run), token_file=PATH (else NOLOCO_RUN_TOKEN or RUN_DIR/run_token), "
                       "stage=S (pipelined: the stage to serve; default the one with the fewest live workers), "
                       "config overrides for this worker (bind=, threads=, device=)");

  LaunchArgs launch;
  auto* launch_cmd = add_launch_command(app, launch);

  auto* password_cmd = app.add_subcommand(
      "store-password", "print the password of the run's store for NOLOCO_RUN_TOKEN (to set up an etcd of your own)");

  CLI11_PARSE(app, argc, argv);
  try {
    if (*train_cmd) return run_train(config_path, overrides);
    if (*join_cmd) return run_join(join_dir, join_args);
    if (*launch_cmd) return run_launch(launch);
    if (*gen_cmd) return run_generate(checkpoint, gen_args);
    if (*export_cmd) return run_export(checkpoint, hf_dir, export_args);
    if (*prepare_cmd) return run_prepare(prepare_args);
    if (*bench_cmd) return run_bench(bench_args);
    if (*sim_cmd) return run_simulate(sim_args);
    if (*report_cmd) return run_report(report_args);
    if (*password_cmd) {
      const char* token = std::getenv("NOLOCO_RUN_TOKEN");
      if (!token || !*token) throw std::invalid_argument("store-password: set NOLOCO_RUN_TOKEN to the run's token");
      fmt::print("{}\n", store_password(token));
      return 0;
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
