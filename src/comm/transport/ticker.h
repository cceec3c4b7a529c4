// A watchdog thread: calls `tick` every `period` until `tick` returns true
// (done) or the Ticker is destroyed, which waits for a tick under way. What
// waits on Gloo or the store while someone has to keep looking (a member
// given up, a try declared failed) runs beside one. A tick that could not
// reach the store learnt nothing: the next one asks again (an exception
// leaving the thread would end the process).
#pragma once
#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>

#include "comm/store/store_outage.h"

namespace noloco {

class Ticker {
 public:
  Ticker(std::chrono::milliseconds period, std::function<bool()> tick)
      : thread_([this, period, tick = std::move(tick)] {
          std::unique_lock<std::mutex> lock(mutex_);
          while (!wake_.wait_for(lock, period, [&] { return stopping_; }))
            try {
              if (tick()) return;
            } catch (const StoreUnreachable&) {
            }
        }) {}
  ~Ticker() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    wake_.notify_one();
    thread_.join();
  }
  Ticker(const Ticker&) = delete;
  Ticker& operator=(const Ticker&) = delete;

 private:
  std::mutex mutex_;
  std::condition_variable wake_;
  bool stopping_ = false;
  std::thread thread_;  // last: it starts once the members above exist
};

}  // namespace noloco
