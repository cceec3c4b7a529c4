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
// nothing of the run. A server of our own (one polling thread, a deadline
// on each whole request): cpp-httplib's thread per connection and deadline
// per byte let a few strangers trickling headers hold every thread.
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
  // A request's head must have come within kRequestDeadline of its
  // connection, and its answer have left within kAnswerDeadline; past
  // kMostConnections the oldest connection is closed for a new one.
  static constexpr auto kRequestDeadline = std::chrono::seconds(2);
  static constexpr auto kAnswerDeadline = std::chrono::seconds(10);
  static constexpr size_t kMostConnections = 256;
  static constexpr size_t kLongestHead = 8192;
  // Listens on bind:port (port 0: a free one) until destroyed; `state` gives the page's data.
  ViewServer(const std::string& bind, int port, std::string key, std::function<nlohmann::json()> state);
  ~ViewServer();
  ViewServer(const ViewServer&) = delete;
  ViewServer& operator=(const ViewServer&) = delete;
  int port() const { return port_; }
  // http://HOST:PORT/?key=KEY, HOST being the address bound (loopback's for 0.0.0.0).
  std::string url() const;

 private:
  void serve();
  // The whole answer to a request `head` (its lines, the blank one excluded).
  std::string answer(const std::string& head) const;

  const std::string bind_, key_;
  const std::function<nlohmann::json()> state_;
  int listen_fd_ = -1, wake_fd_ = -1, port_ = 0;
  std::atomic<bool> stopping_{false};
  std::thread thread_;
};

}  // namespace noloco
