// A real etcd cluster on loopback for tests: `members` etcd processes (the
// Debian binary) forming one Raft group, authentication on (user root), each
// killable on its own; all of them killed and their data removed at the end.
#pragma once
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "comm/store/etcd_server.h"
#include "comm/store/etcd_store.h"
#include "test_util.h"

namespace noloco::testing {

class EtcdCluster {
 public:
  EtcdCluster(int members, const std::string& root_password) {
    std::vector<int> peer_ports;
    std::string initial;
    for (int i = 0; i < members; ++i) {
      client_ports_.push_back(free_port());
      peer_ports.push_back(free_port());
      initial += fmt::format("{}m{}=http://127.0.0.1:{}", i ? "," : "", i, peer_ports.back());
    }
    for (int i = 0; i < members; ++i) {
      const auto client = fmt::format("http://127.0.0.1:{}", client_ports_[size_t(i)]);
      const auto peer = fmt::format("http://127.0.0.1:{}", peer_ports[size_t(i)]);
      pids_.push_back(spawn({EtcdServer::binary(), fmt::format("--name=m{}", i), "--data-dir=" + dir_ / ("m" + std::to_string(i)),
                             "--listen-client-urls=" + client, "--advertise-client-urls=" + client,
                             "--listen-peer-urls=" + peer, "--initial-advertise-peer-urls=" + peer,
                             "--initial-cluster=" + initial, "--initial-cluster-state=new", "--logger=zap",
                             "--log-level=error"},
                            dir_ / fmt::format("m{}.log", i)));
    }
    // Up (a leader elected) once authentication can be switched on.
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    for (;;) {
      try {
        EtcdServer::turn_on_authentication(endpoint(0), root_password);
        return;
      } catch (const std::exception& e) {
        if (std::chrono::steady_clock::now() > deadline)
          throw std::runtime_error(std::string("the test's etcd cluster did not come up: ") + e.what());
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
  }
  ~EtcdCluster() {
    for (size_t i = 0; i < pids_.size(); ++i) kill(int(i));
  }
  EtcdCluster(const EtcdCluster&) = delete;
  EtcdCluster& operator=(const EtcdCluster&) = delete;

  std::string endpoint(int member) const {
    return fmt::format("http://127.0.0.1:{}", client_ports_[size_t(member)]);
  }
  // Every member's, comma-separated, member 0 first.
  std::string endpoints() const {
    std::string out;
    for (size_t i = 0; i < client_ports_.size(); ++i) out += (i ? "," : "") + endpoint(int(i));
    return out;
  }
  // SIGSTOP: its connections are accepted by the kernel and never answered, as a hung machine's.
  void stop(int member) { ::kill(pids_[size_t(member)], SIGSTOP); }
  void resume(int member) { ::kill(pids_[size_t(member)], SIGCONT); }
  void kill(int member) {
    pid_t& pid = pids_[size_t(member)];
    if (pid <= 0) return;
    ::kill(pid, SIGKILL);
    ::waitpid(pid, nullptr, 0);
    pid = -1;
  }

 private:
  static pid_t spawn(std::vector<std::string> args, const std::string& log) {
    const pid_t pid = ::fork();
    if (pid == 0) {
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (FILE* f = std::fopen(log.c_str(), "w")) {
        ::dup2(::fileno(f), 1);
        ::dup2(::fileno(f), 2);
      }
      std::vector<char*> argv;
      for (auto& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      ::execv(argv[0], argv.data());
      ::_exit(127);
    }
    return pid;
  }
  TempDir dir_;
  std::vector<int> client_ports_;
  std::vector<pid_t> pids_;
};

}  // namespace noloco::testing
