// Liveness: every launched worker bumps a counter in the run's store once a
// second from its own thread and store connection. A frozen process or a lost
// machine stops bumping; a worker that is merely slow (long steps, a big
// exchange) does not. The launcher kills workers that go silent, and a NoLoCo
// replica stops waiting for a silent partner.
// Progress: with each beat the worker also publishes how far it has got
// (inner steps taken, and time spent waiting for live partners), so that a
// partner waits for a replica that is behind but moving, and gives up one
// that is alive but stuck.
#pragma once
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <thread>

#include "comm/store/store.h"

namespace noloco {

// The counter of worker `worker` (global rank) in the run with `token`, in the unprefixed store.
std::string heartbeat_key(const std::string& token, int worker);
// Its progress counter, beside it.
std::string progress_key(const std::string& token, int worker);

class Heartbeat {
 public:
  // `store` is a connection of its own: the training thread's store calls may block (waits).
  Heartbeat(StorePtr store, const std::string& token, int worker,
            std::chrono::milliseconds period = std::chrono::milliseconds(1000));
  ~Heartbeat();
  // The worker moved on (an inner step, a second spent waiting for a live
  // partner); published with the next beat. Thread-safe.
  void progressed() { progress_.fetch_add(1, std::memory_order_relaxed); }

 private:
  std::atomic<int64_t> progress_{0};
  std::mutex mutex_;
  std::condition_variable wake_;
  bool stop_ = false;
  std::thread thread_;
};

// Tracks the heartbeat counters of some workers: silent() names how long a
// worker's counter has not moved (zero until its first beat).
class HeartbeatWatch {
 public:
  HeartbeatWatch(StorePtr store, std::string token);
  // Reads `worker`'s counter; returns the seconds since it last changed, or 0
  // if it never beat since watching began (starting up) or changed just now.
  double silent_seconds(int worker);
  // `worker` was started just now, its counter at zero: from now on, until
  // its first beat, silent_seconds counts from this moment (a process frozen
  // before its first beat is silent, not starting up forever).
  void expect(int worker);
  // Whether `worker`'s counter has moved past zero.
  bool beating(int worker) const;
  // Seconds since `worker`'s progress counter last moved (0 the first time it is read).
  double idle_seconds(int worker);

 private:
  StorePtr store_;
  std::string token_;
  struct Seen {
    int64_t count = -1;
    std::chrono::steady_clock::time_point since;
    bool expected = false;
  };
  std::map<int, Seen> seen_, progress_;
};

}  // namespace noloco
