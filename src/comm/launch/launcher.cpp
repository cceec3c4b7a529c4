#include "comm/launch/launcher.h"

#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <thread>
#include <fstream>
#include <memory>
#include <utility>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "comm/store/etcd_server.h"
#include "comm/store/etcd_store.h"
#include "comm/membership/membership.h"
#include "comm/store/store.h"
#include "comm/view/status_board.h"
#include "comm/membership/heartbeat.h"
#include "util/error_text.h"
#include "util/files.h"
#include "util/log.h"
#include "util/run_files.h"
#include "util/run_token.h"

namespace noloco {

namespace {

std::atomic<int> forwarded_signal{0};

// The workers' pids, for the signal handler: it passes SIGINT/SIGTERM on at
// once, so a launcher held up in a store call still stops its run at every
// moment (the supervision loop sees the signal when the call returns).
std::atomic<pid_t>* signalled_pids = nullptr;
std::atomic<int> signalled_count{0};

void on_signal(int sig) {
  forwarded_signal = sig;
  for (int i = 0; i < signalled_count.load(); ++i)
    if (const pid_t pid = signalled_pids[i].load(); pid > 0) ::kill(pid, sig);
}

}  // namespace

std::string WorkerExit::describe() const {
  if (signal != 0)
    return fmt::format("worker {} was killed by signal {} ({}) after {:.1f}s{}", rank, signal, strsignal(signal), seconds,
                       why.empty() ? "" : " (" + why + ")");
  if (joined)
    return ok() ? fmt::format("worker {} (joined) finished", rank)
                : fmt::format("worker {} (joined) was lost: {}", rank, why);
  // Lost as the run's store tells (a run without our launcher): no exit code to give.
  if (!ok() && !why.empty()) return fmt::format("worker {} was lost: {}", rank, why);
  if (exit_code != 0) return fmt::format("worker {} exited with code {} after {:.1f}s", rank, exit_code, seconds);
  return fmt::format("worker {} finished after {:.1f}s", rank, seconds);
}

namespace {

// SIGINT/SIGTERM are caught for the launch and restored after it.
class ForwardedSignals {
 public:
  explicit ForwardedSignals(int workers) : pids_(new std::atomic<pid_t>[size_t(workers)]) {
    for (int i = 0; i < workers; ++i) pids_[size_t(i)] = -1;
    signalled_pids = pids_.get();
    signalled_count = workers;
    struct sigaction sa {};
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    ::sigaction(SIGINT, &sa, &old_int_);
    ::sigaction(SIGTERM, &sa, &old_term_);
  }
  ~ForwardedSignals() {
    ::sigaction(SIGINT, &old_int_, nullptr);
    ::sigaction(SIGTERM, &old_term_, nullptr);
    signalled_count = 0;
    signalled_pids = nullptr;
  }
  static bool pending() { return forwarded_signal.load() != 0; }
  // Worker `rank` is now process `pid` (-1: none).
  void track(int rank, pid_t pid) { pids_[size_t(rank)] = pid; }

 private:
  std::unique_ptr<std::atomic<pid_t>[]> pids_;
  struct sigaction old_int_ {}, old_term_ {};
};

int64_t available_memory_bytes() {
  std::ifstream in("/proc/meminfo");
  std::string key;
  int64_t kb = 0;
  std::string unit;
  while (in >> key >> kb >> unit)
    if (key == "MemAvailable:") return kb * 1024;
  return int64_t(1) << 40;
}

}  // namespace

void check_local_capacity(int64_t workers, int64_t bytes_per_worker, int64_t allowed) {
  if (allowed > 0) {
    if (workers > allowed)
      throw std::invalid_argument(fmt::format("{} workers, more than max_local_workers={}", workers, allowed));
    return;
  }
  const int64_t cores = std::max(1u, std::thread::hardware_concurrency());
  const int64_t memory = available_memory_bytes();
  const int64_t limit = std::min(8 * cores, std::max<int64_t>(1, memory / std::max<int64_t>(1, bytes_per_worker)));
  if (workers > limit)
    throw std::invalid_argument(fmt::format(
        "{} workers on this machine ({} cores, {:.1f} GiB available): it hosts at most {} (8 per core, about {:.0f} MiB "
        "each); set max_local_workers=N to start more anyway",
        workers, cores, double(memory) / double(1 << 30), limit, double(bytes_per_worker) / double(1 << 20)));
}

namespace {

using Clock = std::chrono::steady_clock;

std::string own_executable() {
  char exe[4096];
  const ssize_t len = ::readlink("/proc/self/exe", exe, sizeof exe - 1);
  if (len <= 0) throw std::runtime_error("cannot find the noloco executable (/proc/self/exe)");
  exe[len] = '\0';
  return exe;
}

}  // namespace

pid_t start_process(const std::vector<std::string>& command, std::vector<std::string> env, const std::string& netns) {
  if (command.empty()) throw std::invalid_argument("start_process: no command");
  const pid_t pid = ::fork();
  if (pid < 0) throw std::runtime_error(fmt::format("fork failed: {}", std::strerror(errno)));
  if (pid > 0) return pid;
  // It must not outlive the process that started it.
  ::prctl(PR_SET_PDEATHSIG, SIGTERM);
  if (!netns.empty()) {
    const int fd = ::open(netns.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0 || ::setns(fd, CLONE_NEWNET) != 0) {
      std::fprintf(stderr, "noloco: error: cannot enter %s: %s\n", netns.c_str(), std::strerror(errno));
      ::_exit(126);
    }
  }
  for (auto& e : env) ::putenv(e.data());
  std::vector<char*> argv;
  for (const auto& a : command) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  ::execvp(argv[0], argv.data());
  std::fprintf(stderr, "noloco: error: cannot start %s: %s\n", argv[0], std::strerror(errno));
  ::_exit(127);
}

pid_t start_noloco_process(const std::vector<std::string>& args, std::vector<std::string> env,
                           const std::string& netns) {
  std::vector<std::string> command{own_executable()};
  command.insert(command.end(), args.begin(), args.end());
  return start_process(command, std::move(env), netns);
}

namespace {

// The launcher's side of a local run: starts the workers, reaps their exits
// and applies the failure policy (restart, stop the others), and kills a
// worker whose heartbeat stops, so that a hang takes the path of a crash.
class WorkerSupervisor {
 public:
  WorkerSupervisor(const LaunchPlan& plan, std::vector<std::string> worker_args, std::string token,
                   std::string store_endpoint, StorePtr store, ForwardedSignals& signals)
      : plan_(plan),
        n_(plan.workers),
        worker_args_(std::move(worker_args)),
        token_(std::move(token)),
        endpoint_(std::move(store_endpoint)),
        store_(std::move(store)),
        signals_(signals),
        heartbeats_(store_, token_),
        pids_(size_t(n_), -1),
        why_(size_t(n_)),
        restarts_left_(size_t(n_), plan.comm.restarts),
        restarting_(size_t(n_), false),
        lost_(size_t(n_), false) {}

  // `restart`: how many times this worker was started before (NOLOCO_RESTARTED).
  void spawn(int rank, int64_t restart);
  int running() const { return running_; }
  // Forwards a SIGINT/SIGTERM the launcher got; the run ends with it.
  void take_signal(LaunchResult& result);
  // Records the workers that exited since, if any did, and acts on each; false if none did.
  bool reap(LaunchResult& result);
  // Once a second: kills the workers whose heartbeat stopped; after a stop
  // request, kills whoever outlived its grace period.
  void check_workers();
  // Followed since they joined (check_workers reads their heartbeats too), so
  // that at the end one that died long ago is given up at once.
  HeartbeatWatch& heartbeats() { return heartbeats_; }

 private:
  void on_failure(WorkerExit& e, LaunchResult& result);
  void watch_joiners();
  // Workers restarted together: a replica of several workers (its group is
  // formed anew, and all of them take the state), else each worker alone.
  int unit_of(int rank) const { return plan_.layout().unit_of(rank); }
  std::vector<int> ranks_of_unit(int unit) const { return plan_.layout().ranks_of_unit(unit); }
  bool running_outside(int unit) const;
  // A unit being restarted starts again once the last of its workers has exited.
  void restart_unit_once_down(int unit);
  // A replica of several workers is lost with any of them; the others would
  // wait in its group's collectives (NCCL's, for its whole timeout).
  void stop_replica_of(int rank);
  // A pipeline stage whose every worker is lost: nothing can route through it.
  bool stage_is_lost(int stage) const;
  void kill_all(int sig);
  void stop_all(int sig);

  const LaunchPlan& plan_;
  const int n_;
  const std::vector<std::string> worker_args_;
  const std::string token_, endpoint_;
  const StorePtr store_;
  ForwardedSignals& signals_;
  const Clock::time_point start_ = Clock::now();
  HeartbeatWatch heartbeats_;
  std::vector<pid_t> pids_;
  std::vector<std::string> why_;  // why the launcher itself killed a worker
  std::vector<int64_t> restarts_left_;  // by unit
  std::vector<bool> restarting_;        // by unit: its workers are being stopped, to start again
  std::vector<bool> lost_;  // failed and not restarted
  int running_ = 0;
  bool terminating_ = false;
  Clock::time_point terminate_deadline_;
  Clock::time_point last_check_ = Clock::now();
};

void WorkerSupervisor::spawn(int r, int64_t restart) {
  std::vector<std::string> env_vars = {
      fmt::format("RANK={}", r),          fmt::format("WORLD_SIZE={}", n_),
      fmt::format("LOCAL_RANK={}", r),    fmt::format("LOCAL_WORLD_SIZE={}", n_),
      "TORCHELASTIC_USE_AGENT_STORE=True", "NOLOCO_RUN_TOKEN=" + token_, "NOLOCO_STORE=" + endpoint_};
  if (restart > 0) env_vars.push_back(fmt::format("NOLOCO_RESTARTED={}", restart));
  // As torchrun: the cores shared out (our own workers set their threads from LOCAL_WORLD_SIZE).
  if (plan_.users_program && !std::getenv("OMP_NUM_THREADS"))
    env_vars.push_back(fmt::format("OMP_NUM_THREADS={}", std::max(1, int(std::thread::hardware_concurrency()) / n_)));
  std::vector<std::string> args = worker_args_;
  // Behind a capped link the worker listens on its own address there.
  if (plan_.links) args.push_back("bind=" + plan_.links->worker_address(r));
  const auto netns = plan_.links ? plan_.links->netns_path(r) : "";
  const pid_t pid =
      plan_.users_program ? start_process(args, env_vars, netns) : start_noloco_process(args, env_vars, netns);
  pids_[size_t(r)] = pid;
  signals_.track(r, pid);
  heartbeats_.expect(r);  // supervised from its start: one frozen before its first beat is hung too
  ++running_;
}

void WorkerSupervisor::take_signal(LaunchResult& result) {
  if (const int sig = forwarded_signal.exchange(0)) {
    spdlog::info("forwarding signal {} to the workers", sig);
    stop_all(sig);
    result.signal = sig;
  }
}

bool WorkerSupervisor::reap(LaunchResult& result) {
  // Every worker that has exited by now, those killed by a signal first: the
  // others' errors (a connection reset by the dead one) follow from such a
  // death, and the run's error names the first failure it acts on.
  // Each worker by its pid: the store's etcd is a child too, whose end is its own to hear (EtcdServer::exited).
  std::vector<std::pair<int, int>> exited;  // (rank, wait status)
  for (int r = 0; r < n_; ++r) {
    int status = 0;
    if (pids_[size_t(r)] > 0 && ::waitpid(pids_[size_t(r)], &status, WNOHANG) == pids_[size_t(r)])
      exited.emplace_back(r, status);
  }
  std::stable_sort(exited.begin(), exited.end(), [](const auto& a, const auto& b) {
    return WIFSIGNALED(a.second) && !WIFSIGNALED(b.second);
  });
  for (const auto& [rank, status] : exited) {
    WorkerExit e;
    e.rank = rank;
    e.why = std::exchange(why_[size_t(rank)], "");
    e.seconds = std::chrono::duration<double>(Clock::now() - start_).count();
    if (WIFSIGNALED(status)) {
      e.signal = WTERMSIG(status);
      e.exit_code = -1;
    } else {
      e.exit_code = WEXITSTATUS(status);
    }
    pids_[size_t(rank)] = -1;
    signals_.track(rank, -1);
    --running_;
    if (!e.ok() && result.signal == 0) on_failure(e, result);
    result.exits.push_back(e);
    restart_unit_once_down(unit_of(rank));
  }
  return !exited.empty();
}

void WorkerSupervisor::on_failure(WorkerExit& e, LaunchResult& result) {
  spdlog::info("{}", e.describe());
  // Later NoLoCo groupings of its stage leave it out.
  try {
    // A replica of several workers is lost with any of them (its group's collectives fail).
    const auto layout = plan_.layout();
    declare_dead(store_, token_, record::replica_group(layout.stages(), layout.stage_of(e.rank)), layout.replica_of(e.rank));
  } catch (const std::exception& error) {
    // Its partners notice by themselves (a closed connection, a silent heartbeat).
    spdlog::warn("could not record worker {}'s failure in the store: {}", e.rank, error.what());
  }
  const int unit = unit_of(e.rank);
  if (!plan_.keep_going_on_failure && !terminating_) {
    spdlog::info("method {} cannot continue without worker {}; stopping the others", plan_.method, e.rank);
    stop_all(SIGTERM);
  } else if (restarting_[size_t(unit)]) {
    e.restarted = true;  // stopped with its replica, which starts again whole
  } else if (plan_.keep_going_on_failure && !terminating_ && running_outside(unit) && restarts_left_[size_t(unit)] > 0) {
    // It rejoins from a live replica; with none left there is nothing to rejoin.
    --restarts_left_[size_t(unit)];
    restarting_[size_t(unit)] = true;
    e.restarted = true;
    if (plan_.replica_workers > 1)
      spdlog::info("restarting replica {} (its {} workers); it will take its state from a live replica", unit,
                   plan_.replica_workers);
    else
      spdlog::info("restarting worker {}; it will take its state from a live replica", e.rank);
  }
  lost_[size_t(e.rank)] = !e.restarted;
  if (plan_.keep_going_on_failure && !terminating_ && plan_.replica_workers > 1) stop_replica_of(e.rank);
  const int stage = plan_.layout().stage_of(e.rank);
  if (plan_.keep_going_on_failure && !terminating_ && stage_is_lost(stage)) {
    result.stopped = fmt::format("pipeline stage {} has no live worker left (all {} of its workers failed)", stage,
                                 plan_.layout().replicas());
    spdlog::info("{}; stopping the others", result.stopped);
    stop_all(SIGTERM);
  }
}

bool WorkerSupervisor::running_outside(int unit) const {
  for (int r = 0; r < n_; ++r)
    if (unit_of(r) != unit && pids_[size_t(r)] > 0) return true;
  return false;
}

void WorkerSupervisor::restart_unit_once_down(int unit) {
  if (!restarting_[size_t(unit)] || terminating_) return;
  const auto ranks = ranks_of_unit(unit);
  for (const int r : ranks)
    if (pids_[size_t(r)] > 0) return;
  restarting_[size_t(unit)] = false;
  const int64_t restart = plan_.comm.restarts - restarts_left_[size_t(unit)];
  for (const int r : ranks) {
    try {
      store_->set(heartbeat_key(token_, r), std::vector<uint8_t>{'0'});  // silent until the new one beats
    } catch (const std::exception& error) {
      spdlog::warn("could not reset worker {}'s heartbeat: {}", r, error.what());
    }
    spawn(r, restart);
  }
}

void WorkerSupervisor::check_workers() {
  if (terminating_) {
    if (Clock::now() > terminate_deadline_) kill_all(SIGKILL);
    return;
  }
  if (Clock::now() - last_check_ < std::chrono::seconds(1)) return;
  last_check_ = Clock::now();
  for (int r = 0; r < n_; ++r) {
    if (pids_[size_t(r)] <= 0 || !why_[size_t(r)].empty()) continue;
    double silent = 0;
    try {
      silent = heartbeats_.silent_seconds(r);
    } catch (const std::exception& error) {
      spdlog::warn("could not read worker {}'s heartbeat: {}", r, error.what());
      return;  // the store is busy: look again in a second
    }
    const double timeout = plan_.comm.heartbeat_timeout;
    if (plan_.users_program && !heartbeats_.beating(r)) continue;
    // Starting up (loading LibTorch and the data on a busy machine) may
    // take longer than a beat's period; never longer than startup_timeout.
    const double allowed = heartbeats_.beating(r) ? timeout : std::max(timeout, plan_.comm.startup_timeout);
    if (silent <= allowed) continue;
    why_[size_t(r)] = fmt::format("no heartbeat for {:.0f}s: hung", silent);
    spdlog::info("worker {} sent no heartbeat for {:.0f} s; killing it", r, silent);
    ::kill(pids_[size_t(r)], SIGKILL);
  }
  watch_joiners();
}

void WorkerSupervisor::watch_joiners() {
  if (plan_.join_dir.empty()) return;
  try {
    for (int stage = 0; stage < plan_.stages; ++stage)
      for (const int member : joined_members(store_, token_, record::replica_group(plan_.stages, stage)))
        heartbeats_.silent_seconds(plan_.layout().speaker(member, stage));
  } catch (const std::exception&) {
    // The store is busy: look again in a second.
  }
}

void WorkerSupervisor::stop_replica_of(int rank) {
  for (const int r : ranks_of_unit(unit_of(rank))) {
    if (r == rank || pids_[size_t(r)] <= 0 || !why_[size_t(r)].empty()) continue;
    why_[size_t(r)] = fmt::format("stopped: worker {} of its replica failed", rank);
    spdlog::info("stopping worker {}: its replica lost worker {}", r, rank);
    ::kill(pids_[size_t(r)], SIGTERM);
  }
}

bool WorkerSupervisor::stage_is_lost(int stage) const {
  for (int r = 0; r < n_; ++r)
    if (plan_.layout().stage_of(r) == stage && !lost_[size_t(r)]) return false;
  return plan_.stages > 1;
}

void WorkerSupervisor::kill_all(int sig) {
  for (auto pid : pids_)
    if (pid > 0) ::kill(pid, sig);
}

void WorkerSupervisor::stop_all(int sig) {
  kill_all(sig);
  if (!terminating_) terminate_deadline_ = Clock::now() + std::chrono::seconds(10);
  terminating_ = true;
}

// join.json (and the token the launcher made up) in the run directory while
// the run is on, so that `noloco join` on this machine finds the store.
class JoinInvitation {
 public:
  JoinInvitation(const LaunchPlan& plan, const std::string& endpoint, const std::string& token, bool token_made_up)
      : dir_(plan.join_dir) {
    if (dir_.empty()) return;
    if (token_made_up) write_file_atomic(run_files::in(dir_, run_files::kRunToken), token + "\n", 0600);
    write_json_atomic(run_files::in(dir_, run_files::kJoinInvitation), {{"store", endpoint}, {"local_workers", plan.workers}});
  }
  ~JoinInvitation() {
    if (dir_.empty()) return;
    ::unlink(run_files::in(dir_, run_files::kJoinInvitation).c_str());
    ::unlink(run_files::in(dir_, run_files::kRunToken).c_str());
  }
  JoinInvitation(const JoinInvitation&) = delete;
  JoinInvitation& operator=(const JoinInvitation&) = delete;

 private:
  std::string dir_;
};

}  // namespace

JoinInvitationFile read_join_invitation(const std::string& dir, const std::string& command) {
  const auto path = run_files::in(dir, run_files::kJoinInvitation);
  if (!file_exists(path))
    throw std::invalid_argument(fmt::format(
        "{}: {} does not exist: no run is training from there on this machine; from elsewhere, name its store",
        command, path));
  const auto j = nlohmann::json::parse(read_file(path), nullptr, false);
  if (!j.is_object() || !j.contains("store") || !j["store"].is_string() ||
      !j.value("local_workers", nlohmann::json()).is_number_integer() || j["local_workers"].get<int64_t>() < 1)
    throw std::invalid_argument(
        fmt::format("{}: {} is not a launcher's invitation (store, local_workers)", command, path));
  return {j["store"].get<std::string>(), j["local_workers"].get<int>()};
}

std::string run_token_of(const std::string& token_file, const std::string& command) {
  if (const auto given = run_token_in_environment()) return *given;
  struct stat st {};
  if (::stat(token_file.c_str(), &st) != 0)
    throw std::invalid_argument(
        fmt::format("{}: no token: set NOLOCO_RUN_TOKEN, or give token_file= ({} does not exist)", command, token_file));
  if ((st.st_mode & 077) != 0)
    throw std::invalid_argument(
        fmt::format("{}: {} can be read by others than its owner; chmod 600 it first", command, token_file));
  auto token = read_file(token_file);
  while (!token.empty() && (token.back() == '\n' || token.back() == '\r')) token.pop_back();
  if (token.empty()) throw std::invalid_argument(fmt::format("{}: {} holds no token", command, token_file));
  return token;
}

namespace {

// The workers that joined the run (members of each stage's scope), each once it ended (await_member_end).
std::vector<WorkerExit> await_joiners(const LaunchPlan& plan, const StorePtr& store, const std::string& token,
                                      HeartbeatWatch& heartbeats, Clock::time_point launched) {
  std::vector<WorkerExit> out;
  if (plan.join_dir.empty()) return out;
  const auto stopped = []() -> std::optional<std::string> {
    if (!ForwardedSignals::pending()) return std::nullopt;
    return "not waited for (the launcher was stopped)";
  };
  for (int stage = 0; stage < plan.stages; ++stage) {
    const auto scope = record::replica_group(plan.stages, stage);
    for (const int member : joined_members(store, token, scope)) {
      WorkerExit e;
      e.rank = plan.layout().speaker(member, stage);  // as the joiner took it
      e.joined = true;
      if (!heartbeats.beating(e.rank)) heartbeats.expect(e.rank);  // else followed since it joined
      if (const auto why =
              await_member_end(store, token, scope, member, e.rank, heartbeats, plan.comm.heartbeat_timeout, stopped)) {
        e.exit_code = 1;
        e.why = *why;
      }
      e.seconds = std::chrono::duration<double>(Clock::now() - launched).count();
      out.push_back(e);
    }
  }
  std::sort(out.begin(), out.end(), [](const WorkerExit& a, const WorkerExit& b) { return a.rank < b.rank; });
  return out;
}

}  // namespace

LaunchResult launch_local_workers(const LaunchPlan& plan, const std::vector<std::string>& worker_args) {
  const auto launched = Clock::now();
  ForwardedSignals signals(plan.workers);
  const auto given = run_token_in_environment();
  const std::string token = given ? *given : new_run_token();
  // The run's store: etcd on a unix socket only the launcher's user can
  // reach (its workers too, from their network namespaces behind capped
  // links), authenticated with the run's token.
  EtcdServer etcd(store_password(token), &ForwardedSignals::pending);
  // Short: the supervision loop must come back to signals and exits, and a
  // local store that does not answer a small request in seconds is in trouble.
  const auto timeout =
      std::min(std::chrono::milliseconds(int64_t(plan.comm.peer_timeout * 1000)), std::chrono::milliseconds(5000));
  const StorePtr store = c10::make_intrusive<EtcdStore>(etcd.endpoint(), "root", store_password(token), timeout);
  WorkerSupervisor workers(plan, worker_args, token, etcd.endpoint(), store, signals);
  const JoinInvitation invitation(plan, etcd.endpoint(), token, !given);
  for (const int r : plan.start_from_peers) {
    start_from_peer_on_resume(store, token, r, plan.layout());
    spdlog::info("worker {} holds no checkpoint to resume from; it will take its state from a live replica", r);
  }
  const auto from_peer = [&](int r) {
    return std::find(plan.start_from_peers.begin(), plan.start_from_peers.end(), r) != plan.start_from_peers.end();
  };
  for (int r = 0; r < plan.workers && !ForwardedSignals::pending(); ++r) workers.spawn(r, from_peer(r) ? 1 : 0);

  LaunchResult result;
  bool store_given_up = false;
  workers.take_signal(result);  // one that came while starting
  while (workers.running() > 0) {
    workers.take_signal(result);
    if (workers.reap(result)) continue;
    // A store that does not come back is left gone: the workers end once their store_outage has passed.
    store_given_up = store_given_up || !etcd.restart_if_ended("", "the workers train on meanwhile");
    workers.check_workers();
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  std::stable_sort(result.exits.begin(), result.exits.end(), [](auto& a, auto& b) { return a.rank < b.rank; });
  if (!result.signal) result.joiners = await_joiners(plan, store, token, workers.heartbeats(), launched);
  try {  // the store goes with this launcher: `noloco watch`es read the run's end first
    let_watchers_catch_up(*run_scope(store, token, record::kStatus), std::chrono::seconds(2));
  } catch (const std::exception& e) {
    spdlog::debug("the run's watchers may miss its last status: {}", error_text(e));
  }
  return result;
}

}  // namespace noloco
