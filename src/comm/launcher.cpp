#include "comm/launcher.h"

#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <thread>
#include <fstream>
#include <memory>
#include <utility>

#include <fmt/format.h>

#include "comm/etcd_server.h"
#include "comm/etcd_store.h"
#include "comm/membership.h"
#include "comm/store.h"
#include "comm/heartbeat.h"
#include "util/log.h"

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

LaunchResult launch_local_workers(const LaunchPlan& plan, const std::vector<std::string>& worker_args) {
  const auto& c = plan.comm;
  const int n = plan.workers;
  ForwardedSignals signals(n);
  const auto start = std::chrono::steady_clock::now();
  const char* given = std::getenv("NOLOCO_RUN_TOKEN");
  const std::string token = given && *given ? given : new_run_token();
  // The run's store: etcd on a unix socket only the launcher's user can
  // reach (its workers too, from their network namespaces behind capped
  // links), authenticated with the run's token.
  const EtcdServer etcd(token, &ForwardedSignals::pending);
  // Short: the supervision loop must come back to signals and exits, and a
  // local store that does not answer a small request in seconds is in trouble.
  const auto timeout = std::min(std::chrono::milliseconds(int64_t(c.peer_timeout * 1000)), std::chrono::milliseconds(5000));
  const StorePtr store = c10::make_intrusive<EtcdStore>(etcd.endpoint(), "root", token, timeout);

  char exe[4096];
  const ssize_t len = ::readlink("/proc/self/exe", exe, sizeof exe - 1);
  if (len <= 0) throw std::runtime_error("cannot find the noloco executable (/proc/self/exe)");
  exe[len] = '\0';

  std::vector<pid_t> pids(size_t(n), -1);
  // A worker whose heartbeat stops is hung (or its machine is): kill it, so
  // the failure takes the path of a crash instead of stalling the run.
  HeartbeatWatch heartbeats(store, token);
  auto spawn = [&](int r, bool restart) {
    std::vector<std::string> env_vars = {
        fmt::format("RANK={}", r),          fmt::format("WORLD_SIZE={}", n),
        fmt::format("LOCAL_RANK={}", r),    fmt::format("LOCAL_WORLD_SIZE={}", n),
        "TORCHELASTIC_USE_AGENT_STORE=True", "NOLOCO_RUN_TOKEN=" + token, "NOLOCO_STORE=" + etcd.endpoint()};
    if (restart) env_vars.push_back("NOLOCO_RESTARTED=1");
    std::vector<std::string> args = worker_args;
    // Behind a capped link the worker listens on its own address there.
    if (plan.links) args.push_back("bind=" + plan.links->worker_address(r));
    const std::string netns = plan.links ? plan.links->netns_path(r) : "";
    const pid_t pid = ::fork();
    if (pid < 0) throw std::runtime_error(fmt::format("fork failed: {}", std::strerror(errno)));
    if (pid == 0) {
      // A worker must not outlive its launcher.
      ::prctl(PR_SET_PDEATHSIG, SIGTERM);
      if (!netns.empty()) {
        const int fd = ::open(netns.c_str(), O_RDONLY | O_CLOEXEC);
        if (fd < 0 || ::setns(fd, CLONE_NEWNET) != 0) {
          std::fprintf(stderr, "noloco: error: worker %d cannot enter %s: %s\n", r, netns.c_str(), std::strerror(errno));
          ::_exit(126);
        }
      }
      for (auto& e : env_vars) ::putenv(e.data());
      std::vector<char*> argv{exe};
      for (auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
      argv.push_back(nullptr);
      ::execv(exe, argv.data());
      std::fprintf(stderr, "noloco: error: cannot start worker %d: %s\n", r, std::strerror(errno));
      ::_exit(127);
    }
    pids[size_t(r)] = pid;
    signals.track(r, pid);
    heartbeats.expect(r);  // supervised from its start: one frozen before its first beat is hung too
  };
  int running = 0;
  for (int r = 0; r < n && !ForwardedSignals::pending(); ++r, ++running) spawn(r, false);
  std::vector<std::string> why(static_cast<size_t>(n));
  auto last_check = std::chrono::steady_clock::now();

  LaunchResult result;
  std::vector<int64_t> restarts_left(size_t(n), c.restarts);
  std::vector<bool> lost(size_t(n), false);  // failed and not restarted
  // A pipeline stage whose every worker is lost: nothing can route through it.
  auto stage_is_lost = [&](int stage) {
    for (int r = stage; r < n; r += plan.stages)
      if (!lost[size_t(r)]) return false;
    return plan.stages > 1;
  };
  auto kill_all = [&](int sig) {
    for (auto pid : pids)
      if (pid > 0) ::kill(pid, sig);
  };
  bool terminating = false;
  auto terminate_deadline = std::chrono::steady_clock::now();
  auto stop_all = [&](int sig) {
    kill_all(sig);
    if (!terminating) terminate_deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    terminating = true;
  };
  auto take_signal = [&] {
    if (const int sig = forwarded_signal.exchange(0)) {
      spdlog::info("forwarding signal {} to the workers", sig);
      stop_all(sig);
      result.signal = sig;
    }
  };
  take_signal();  // one that came while starting
  while (running > 0) {
    take_signal();
    int status = 0;
    const pid_t pid = ::waitpid(-1, &status, WNOHANG);
    if (pid > 0) {
      const auto it = std::find(pids.begin(), pids.end(), pid);
      if (it == pids.end()) continue;
      WorkerExit e;
      e.rank = int(it - pids.begin());
      e.why = std::exchange(why[size_t(e.rank)], "");
      e.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      if (WIFSIGNALED(status)) {
        e.signal = WTERMSIG(status);
        e.exit_code = -1;
      } else {
        e.exit_code = WEXITSTATUS(status);
      }
      *it = -1;
      signals.track(int(it - pids.begin()), -1);
      --running;
      if (!e.ok() && result.signal == 0) {
        spdlog::info("{}", e.describe());
        // Later NoLoCo groupings of its stage leave it out.
        try {
          declare_dead(store, token, replica_scope(plan.stages, e.rank % plan.stages), e.rank / plan.stages);
        } catch (const std::exception& error) {
          // Its partners notice by themselves (a closed connection, a silent heartbeat).
          spdlog::warn("could not record worker {}'s failure in the store: {}", e.rank, error.what());
        }
        if (!plan.keep_going_on_failure && !terminating) {
          spdlog::info("method {} cannot continue without worker {}; stopping the others", plan.method, e.rank);
          stop_all(SIGTERM);
        } else if (plan.keep_going_on_failure && running > 0 && restarts_left[size_t(e.rank)] > 0) {
          // It rejoins from a live replica; with none left there is nothing to rejoin.
          --restarts_left[size_t(e.rank)];
          e.restarted = true;
          spdlog::info("restarting worker {}; it will take its state from a live replica", e.rank);
          try {
            store->set(heartbeat_key(token, e.rank), std::vector<uint8_t>{'0'});  // silent until the new one beats
          } catch (const std::exception& error) {
            spdlog::warn("could not reset worker {}'s heartbeat: {}", e.rank, error.what());
          }
          spawn(e.rank, true);
          ++running;
        }
        lost[size_t(e.rank)] = !e.restarted;
        const int stage = e.rank % plan.stages;
        if (plan.keep_going_on_failure && !terminating && stage_is_lost(stage)) {
          result.stopped = fmt::format("pipeline stage {} has no live worker left (all {} of its workers failed)",
                                       stage, n / plan.stages);
          spdlog::info("{}; stopping the others", result.stopped);
          stop_all(SIGTERM);
        }
      }
      result.exits.push_back(e);
      continue;
    }
    if (terminating && std::chrono::steady_clock::now() > terminate_deadline) kill_all(SIGKILL);
    if (!terminating && std::chrono::steady_clock::now() - last_check > std::chrono::seconds(1)) {
      last_check = std::chrono::steady_clock::now();
      for (int r = 0; r < n; ++r) {
        if (pids[size_t(r)] <= 0 || !why[size_t(r)].empty()) continue;
        // Starting up (loading LibTorch and the data on a busy machine) may
        // take longer than a beat's period; never longer than this.
        constexpr double kStartupSeconds = 30;
        double silent = 0;
        try {
          silent = heartbeats.silent_seconds(r);
        } catch (const std::exception& error) {
          spdlog::warn("could not read worker {}'s heartbeat: {}", r, error.what());
          break;  // the store is busy: look again in a second
        }
        const double allowed = heartbeats.beating(r) ? c.heartbeat_timeout : std::max(c.heartbeat_timeout, kStartupSeconds);
        if (silent <= allowed) continue;
        why[size_t(r)] = fmt::format("no heartbeat for {:.0f}s: hung", silent);
        spdlog::info("worker {} sent no heartbeat for {:.0f} s; killing it", r, silent);
        ::kill(pids[size_t(r)], SIGKILL);
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  std::stable_sort(result.exits.begin(), result.exits.end(), [](auto& a, auto& b) { return a.rank < b.rank; });
  return result;
}

}  // namespace noloco
