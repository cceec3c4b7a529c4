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
#include <utility>

#include <fmt/format.h>

#include "comm/etcd_server.h"
#include "comm/etcd_store.h"
#include "comm/membership.h"
#include "comm/store.h"
#include "comm/heartbeat.h"

namespace noloco {

namespace {

std::atomic<int> forwarded_signal{0};

void on_signal(int sig) { forwarded_signal = sig; }

}  // namespace

std::string WorkerExit::describe() const {
  if (signal != 0)
    return fmt::format("worker {} was killed by signal {} ({}) after {:.1f}s{}", rank, signal, strsignal(signal), seconds,
                       why.empty() ? "" : " (" + why + ")");
  if (exit_code != 0) return fmt::format("worker {} exited with code {} after {:.1f}s", rank, exit_code, seconds);
  return fmt::format("worker {} finished after {:.1f}s", rank, seconds);
}

std::vector<WorkerExit> launch_local_workers(const LaunchPlan& plan, const std::vector<std::string>& worker_args) {
  const auto& c = plan.comm;
  const bool keep_going_on_failure = plan.keep_going_on_failure;
  const auto start = std::chrono::steady_clock::now();
  const int n = plan.workers;
  const char* given = std::getenv("NOLOCO_RUN_TOKEN");
  const std::string token = given && *given ? given : new_run_token();
  // The run's store: etcd, on `bind` (behind capped links: the launcher's
  // address on their bridge), authenticated with the run's token.
  const std::string store_address = plan.links ? plan.links->host_address() : c.bind;
  const EtcdServer etcd(store_address, int(c.port), token);
  const auto timeout = std::chrono::milliseconds(int64_t(c.peer_timeout * 1000));
  const StorePtr store = c10::make_intrusive<EtcdStore>(etcd.endpoint(), "root", token, timeout);

  char exe[4096];
  const ssize_t len = ::readlink("/proc/self/exe", exe, sizeof exe - 1);
  if (len <= 0) throw std::runtime_error("cannot find the noloco executable (/proc/self/exe)");
  exe[len] = '\0';

  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  ::sigaction(SIGINT, &sa, nullptr);
  ::sigaction(SIGTERM, &sa, nullptr);

  std::vector<pid_t> pids(size_t(n), -1);
  auto spawn = [&](int r) {
    std::vector<std::string> env_vars = {
        fmt::format("RANK={}", r),          fmt::format("WORLD_SIZE={}", n),
        fmt::format("LOCAL_RANK={}", r),    fmt::format("LOCAL_WORLD_SIZE={}", n),
        fmt::format("MASTER_ADDR={}", store_address), fmt::format("MASTER_PORT={}", etcd.port()),
        "TORCHELASTIC_USE_AGENT_STORE=True", "NOLOCO_RUN_TOKEN=" + token, "NOLOCO_STORE=" + etcd.endpoint()};
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
  };
  for (int r = 0; r < n; ++r) spawn(r);
  // A worker whose heartbeat stops is hung (or its machine is): kill it, so
  // the failure takes the path of a crash instead of stalling the run.
  HeartbeatWatch heartbeats(store, token);
  std::vector<std::string> why(static_cast<size_t>(n));
  auto last_check = std::chrono::steady_clock::now();

  std::vector<WorkerExit> exits;
  std::vector<int64_t> restarts_left(size_t(n), c.restarts);
  int running = n;
  auto kill_all = [&](int sig) {
    for (auto pid : pids)
      if (pid > 0) ::kill(pid, sig);
  };
  bool terminating = false, interrupted = false;
  auto terminate_deadline = std::chrono::steady_clock::now();
  while (running > 0) {
    if (const int sig = forwarded_signal.exchange(0)) {
      std::fprintf(stderr, "noloco: forwarding signal %d to the workers\n", sig);
      kill_all(sig);
      interrupted = true;
    }
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
      --running;
      if (!e.ok()) {
        std::fprintf(stderr, "noloco: %s\n", e.describe().c_str());
        // Later NoLoCo groupings of its stage leave it out.
        declare_dead(store, token, replica_scope(plan.stages, e.rank % plan.stages), e.rank / plan.stages);
        if (!keep_going_on_failure && !terminating) {
          std::fprintf(stderr, "noloco: method %s cannot continue without worker %d; stopping the others\n",
                       plan.method.c_str(), e.rank);
          kill_all(SIGTERM);
          terminating = true;
          terminate_deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
        } else if (keep_going_on_failure && !interrupted && running > 0 && restarts_left[size_t(e.rank)] > 0) {
          // It rejoins from a live replica; with none left there is nothing to rejoin.
          --restarts_left[size_t(e.rank)];
          e.restarted = true;
          std::fprintf(stderr, "noloco: restarting worker %d; it will take its state from a live replica\n", e.rank);
          store->set(heartbeat_key(token, e.rank), std::vector<uint8_t>{'0'});  // silent until the new one beats
          heartbeats.reset(e.rank);
          spawn(e.rank);
          ++running;
        }
      }
      exits.push_back(e);
      continue;
    }
    if (terminating && std::chrono::steady_clock::now() > terminate_deadline) kill_all(SIGKILL);
    if (std::chrono::steady_clock::now() - last_check > std::chrono::seconds(1)) {
      last_check = std::chrono::steady_clock::now();
      for (int r = 0; r < n; ++r) {
        if (pids[size_t(r)] <= 0 || !why[size_t(r)].empty()) continue;
        const double silent = heartbeats.silent_seconds(r);
        if (silent <= c.heartbeat_timeout) continue;
        why[size_t(r)] = fmt::format("no heartbeat for {:.0f}s: hung", silent);
        std::fprintf(stderr, "noloco: worker %d sent no heartbeat for %.0f s; killing it\n", r, silent);
        ::kill(pids[size_t(r)], SIGKILL);
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  std::stable_sort(exits.begin(), exits.end(), [](auto& a, auto& b) { return a.rank < b.rank; });
  ::signal(SIGINT, SIG_DFL);
  ::signal(SIGTERM, SIG_DFL);
  return exits;
}

}  // namespace noloco
