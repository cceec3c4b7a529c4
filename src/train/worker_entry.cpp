#include "train/worker_entry.h"

#include <sys/wait.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>

#include <fmt/format.h>

#include "comm/launch/launcher.h"
#include "comm/membership/membership.h"
#include "comm/store/store.h"
#include "config/run_layout.h"
#include "train/run_end.h"
#include "train/trainer.h"
#include "train/worker_life.h"
#include "util/files.h"
#include "util/human.h"
#include "util/log.h"
#include "util/run_files.h"

namespace noloco {

namespace {

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
  if (const char* given = std::getenv(kJoiningReplicaWorker)) {
    JoinerPlace p;
    if (std::sscanf(given, "%d:%d", &p.member, &p.replica_worker) != 2 || p.replica_worker <= 0 ||
        p.replica_worker >= cfg.run.replica_workers || p.member < cfg.run.replicas)
      throw std::invalid_argument(fmt::format("{}='{}' is not a place in a joining replica", kJoiningReplicaWorker, given));
    return p;
  }
  JoinerPlace p;
  p.member = claim_joiner_member(env, cfg, int(cfg.run.replicas), int(cfg.pipeline.stages), stage);
  p.stage = int(stage);
  return p;
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

// The run's token for a joiner, once: from NOLOCO_RUN_TOKEN or `token_file`,
// with the key an https store it hosts must present.
void take_token(WorkerEnv& env, const std::string& token_file) {
  if (!env.token.empty()) return;
  env.token = run_token_of(token_file, "join");
  pin_hosted_store_key(env);
}

// A joiner's config: RUN_DIR/config.yaml where the run trains on this
// machine; else the run's, from its store (a joiner in another home has only
// the lines `noloco serve` printed), kept in RUN_DIR/config.yaml. Only then
// does it need the token (take_token).
TrainConfig joiner_config(WorkerEnv& env, const std::string& run_dir, const std::string& token_file,
                          const std::vector<std::string>& overrides) {
  const auto path = run_files::in(run_dir, run_files::kConfig);
  if (std::filesystem::exists(path)) return load_config(path, overrides);
  take_token(env, token_file);
  std::string published;
  try {
    published = published_run_config(connect_store(env, kJoinFirstContact), env.token);
  } catch (const std::runtime_error& e) {
    throw std::runtime_error(fmt::format("join: {} has no config.yaml, and the run's store at {} could not be read "
                                         "for the run's: {}",
                                         run_dir, store_address(env), e.what()));
  }
  if (published.empty())
    throw std::invalid_argument(fmt::format(
        "join: {} has no config.yaml, and the run's store at {} holds no config (no worker of the run has started)",
        run_dir, store_address(env)));
  auto config = parse_config(published, overrides, "the run's config (from its store)");
  std::filesystem::create_directories(run_dir);
  write_file_atomic(path, published);
  return config;
}

// It ended early, the run's store having stayed away (its summary says why).
bool ended_without_store(const nlohmann::json& own_summary) { return own_summary.contains("store_gone"); }

}  // namespace

int claim_joiner_member(const WorkerEnv& env, const TrainConfig& config, int replicas, int stages, int64_t& stage) {
  const auto timeout = std::chrono::milliseconds(int64_t(config.comm.peer_timeout * 1000));
  // The first contact is bounded on its own: a store that does not answer
  // would otherwise hold a new user silent for twice peer_timeout.
  const auto first_contact = std::min(timeout, kJoinFirstContact);
  spdlog::info("join: reaching the run's store at {} (up to {} s)", store_address(env), first_contact.count() / 1000);
  try {
    const auto run_store = connect_store(env, first_contact);
    if (stage < 0) stage = least_served_stage(run_store, env.token, stages, replicas);
    // Laid out replica-major like the launched workers: member m of stage s is worker m·stages + s.
    return claim_member_id(run_store, env.token, record::replica_group(stages, int(stage)), replicas);
  } catch (const std::runtime_error& e) {
    throw std::runtime_error(fmt::format("join: could not use the run's store at {} (first contact, {} s): {}",
                                         store_address(env), first_contact.count() / 1000, e.what()));
  }
}

int run_worker(TrainConfig& cfg, const WorkerEnv& env) {
  const int stages = int(cfg.pipeline.stages);
  const int per_replica = stages * int(cfg.run.replica_workers);
  if (env.world % per_replica != 0)
    throw std::invalid_argument(fmt::format("WORLD_SIZE={} is not a multiple of the {} workers a replica has "
                                            "(stages={}, replica_workers={})",
                                            env.world, per_replica, stages, cfg.run.replica_workers));
  cfg.run.replicas = env.world / per_replica;
  cfg.validate();
  cfg.validate_workers();
  if (cfg.run.out.empty()) throw std::invalid_argument("launched workers need out=DIR, the same for all of them");
  const auto start = std::chrono::steady_clock::now();
  const auto worker = start_worker(cfg, {env});
  const auto own_summary = train(cfg, worker);
  if (writes_run_summary(env) || (ended_without_store(own_summary) && !launched_by_noloco(env))) {
    try {
      write_run_summary(cfg, worker, own_summary,
                        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    } catch (const std::exception& e) {  // its own training is done and saved: the summary alone is lost
      spdlog::warn("the run's summary.json was not written: {}", e.what());
    }
  }
  finish_worker(worker);
  return ended_without_store(own_summary) ? 1 : 0;
}

// Takes `store`, `token_file` and `stage` as JoinRequest says; `overrides` are
// this machine's own keys, `args` the command's, for the replica's other workers.
int join_run(const std::string& run_dir, const JoinRequest& request, std::vector<std::string> overrides,
             const std::vector<std::string>& args) {
  const auto& store = request.store;
  const auto& token_file = request.token_file;
  const int64_t stage = request.stage;
  WorkerEnv env;
  run_endpoints_from_environment(env);  // NOLOCO_STORE and NOLOCO_RELAY, as `noloco serve` prints them
  int local_workers = 1;                // workers sharing this machine's cores
  if (!store.empty()) {
    env.store_url = store;
  } else if (env.store_url.empty() && !env.agent_store) {
    const auto invitation = read_join_invitation(run_dir, "join");
    env.store_url = invitation.store;
    local_workers = invitation.workers + 1;
  }
  env.agent_store = true;
  overrides.push_back("out=" + run_dir);
  auto cfg = joiner_config(env, run_dir, token_file, overrides);
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
  take_token(env, token_file);
  env.world = int(cfg.workers());
  env.local_world = local_workers + replica_workers - 1;
  const auto place = joiner_place(env, cfg, stage);
  env.rank = run_layout(cfg).rank({place.member, place.replica_worker, place.stage});
  env.local_rank = place.replica_worker;
  if (stages > 1)
    spdlog::info("joining the run in {} as worker {}: stage {} of replica {}", run_dir, env.rank, place.stage,
                 place.member);
  else if (replica_workers > 1 && place.replica_worker == 0)
    spdlog::info("joining the run in {} as replica {} of {} workers (this is its first)", run_dir, place.member,
                 replica_workers);
  else if (place.replica_worker == 0)
    spdlog::info("joining the run in {} as replica {}", run_dir, env.rank);
  const auto others = start_replica_workers(place, replica_workers, env, run_dir, args);
  const auto worker = start_worker(cfg, {env, /*joins=*/true});
  const auto own_summary = train(cfg, worker);
  finish_worker(worker);
  await_replica_workers(others);
  return ended_without_store(own_summary) ? 1 : 0;
}

}  // namespace noloco
