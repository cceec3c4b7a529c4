#include "comm/membership/heartbeat.h"

#include <fmt/format.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

namespace noloco {

std::string heartbeat_key(const std::string& token, int worker) {
  return run_store_key(token, record::heartbeat(worker));
}

std::string progress_key(const std::string& token, int worker) { return run_store_key(token, record::progress(worker)); }

Heartbeat::Heartbeat(StorePtr store, const std::string& token, int worker, std::chrono::milliseconds period) {
  const auto key = heartbeat_key(token, worker), progress = progress_key(token, worker);
  store->add(key, 1);
  thread_ = std::thread([this, store, key, progress, period] {
    std::unique_lock<std::mutex> lock(mutex_);
    int failures = 0;  // in a row: one is a hiccup (a paused process, a busy store), three the store gone
    int64_t published = 0;
    while (!wake_.wait_for(lock, period, [this] { return stop_; })) {
      try {
        store->add(key, 1);
        const int64_t now = progress_.load(std::memory_order_relaxed);
        if (now != published) store->add(progress, now - published);
        published = now;
        failures = 0;
      } catch (const std::exception&) {
        if (++failures == 3) return;  // the run is over
      }
    }
  });
}

Heartbeat::~Heartbeat() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  wake_.notify_one();
  thread_.join();
}

HeartbeatWatch::HeartbeatWatch(StorePtr store, std::string token)
    : store_(std::move(store)), token_(std::move(token)) {}

double HeartbeatWatch::silent_seconds(int worker) {
  const auto now = std::chrono::steady_clock::now();
  const int64_t count = store_->add(heartbeat_key(token_, worker), 0);
  auto& seen = seen_[worker];
  if (count == 0 && seen.expected)  // started and not beating yet: silent since it started
    return std::chrono::duration<double>(now - seen.since).count();
  if (count != seen.count || count == 0) {
    seen.count = count;
    seen.since = now;
    return 0;
  }
  return std::chrono::duration<double>(now - seen.since).count();
}

bool HeartbeatWatch::beating(int worker) const {
  const auto it = seen_.find(worker);
  return it != seen_.end() && it->second.count > 0;
}

double HeartbeatWatch::idle_seconds(int worker) {
  const auto now = std::chrono::steady_clock::now();
  const int64_t count = store_->add(progress_key(token_, worker), 0);
  auto& seen = progress_[worker];
  if (count != seen.count) {
    seen.count = count;
    seen.since = now;
    return 0;
  }
  return std::chrono::duration<double>(now - seen.since).count();
}

void HeartbeatWatch::expect(int worker) {
  auto& seen = seen_[worker];
  seen.count = 0;
  seen.since = std::chrono::steady_clock::now();
  seen.expected = true;
}

}  // namespace noloco
