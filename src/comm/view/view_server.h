// The live page of a run (issue 68), for `noloco watch` and `noloco serve`.
//
// RunWatch reads the run's store on a thread of its own: the workers' status
// entries (comm/view/status_board.h) every quarter second, whom the
// membership holds dead every two seconds, folded into a RunView. A store
// cluster is read at whichever member answers, and a second thread asks
// each member every two seconds, so that the page says which are down. ViewServer
// serves the page over HTTP: only to a request carrying the key derived from
// the run's token (the URL printed carries it, so a script or a headless
// browser opens it with no further input); anything else gets 403 and
// nothing of the run.
#pragma once
#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include <nlohmann/json.hpp>

#include "comm/store/run_keys.h"  // view_key: the key the URL carries
#include "comm/store/store.h"
#include "comm/view/run_view.h"

namespace httplib {
class Server;
}

namespace noloco {

class RunWatch {
 public:
  // `connect` reaches the run's store at `endpoints` (a cluster's members,
  // comma-separated, the one to try first first) or at one of them; it is
  // called again after the store was lost (a store that went away may come
  // back: a restarted serve).
  RunWatch(std::function<StorePtr(const std::string& endpoints)> connect, std::string endpoints, std::string token,
           std::chrono::milliseconds poll = std::chrono::milliseconds(250));
  ~RunWatch();
  RunWatch(const RunWatch&) = delete;
  RunWatch& operator=(const RunWatch&) = delete;
  nlohmann::json state() const;
  // Whether some worker of the run has published under this token yet.
  bool found_run() const { return found_.load(); }

 private:
  void run();
  void read_store(StatusReader& reader, const StorePtr& store, std::chrono::steady_clock::time_point& membership_read);
  void ask_store_members();

  const std::function<StorePtr(const std::string&)> connect_;
  const std::string endpoints_, token_;
  const std::chrono::milliseconds poll_;
  mutable std::mutex mutex_;
  RunView view_;  // under mutex_
  std::atomic<bool> found_{false}, stopping_{false};
  std::thread thread_, members_thread_;
};

class ViewServer {
 public:
  // Connections served at once: strangers holding fewer leave keyed requests answered.
  static constexpr size_t kPageThreads = 8;
  // Listens on bind:port (port 0: a free one) until destroyed; `state` gives the page's data.
  ViewServer(const std::string& bind, int port, std::string key, std::function<nlohmann::json()> state);
  ~ViewServer();
  ViewServer(const ViewServer&) = delete;
  ViewServer& operator=(const ViewServer&) = delete;
  int port() const { return port_; }
  // http://HOST:PORT/?key=KEY, HOST being the address bound (loopback's for 0.0.0.0).
  std::string url() const;

 private:
  const std::string bind_, key_;
  std::unique_ptr<httplib::Server> server_;
  int port_ = 0;
  std::thread thread_;
};

}  // namespace noloco
