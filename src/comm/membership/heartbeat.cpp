#include "comm/membership/heartbeat.h"

#include <algorithm>

#include <fmt/format.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "comm/store/store_outage.h"
#include "comm/store/store_traffic.h"

namespace noloco {

std::string heartbeat_key(const std::string& token, int worker) {
  return run_store_key(token, record::heartbeat(worker));
}

std::string progress_key(const std::string& token, int worker) { return run_store_key(token, record::progress(worker)); }

Heartbeat::Heartbeat(StorePtr store, const std::string& token, int worker, std::chrono::milliseconds period) {
  const auto key = heartbeat_key(token, worker), progress = progress_key(token, worker);
  store->add(key, 1);
  thread_ = std::thread([this, store, key, progress, period] {
    count_this_thread_as_clocked();
    std::unique_lock<std::mutex> lock(mutex_);
    int64_t published = 0;
    // On through a store outage: its beats are also what finds the store back (comm/store/store_outage.h).
    while (!wake_.wait_for(lock, period, [this] { return stop_; })) {
      try {
        store->add(key, 1);
        const int64_t now = progress_.load(std::memory_order_relaxed);
        if (now != published) store->add(progress, now - published);
        published = now;
      } catch (const std::exception&) {
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

namespace {

// Seconds since `since`, or since the store came back if that is later:
// silence across a store outage is the store's, not the member's.
double seconds_since(std::chrono::steady_clock::time_point since, std::chrono::steady_clock::time_point now) {
  return std::chrono::duration<double>(now - std::max(since, store_outage().last_ended())).count();
}

}  // namespace

double HeartbeatWatch::silent_seconds(int worker) {
  const auto now = std::chrono::steady_clock::now();
  const int64_t count = store_->add(heartbeat_key(token_, worker), 0);
  auto& seen = seen_[worker];
  if (count == 0 && seen.expected)  // started and not beating yet: silent since it started
    return seconds_since(seen.since, now);
  if (count != seen.count || count == 0) {
    seen.count = count;
    seen.since = now;
    return 0;
  }
  return seconds_since(seen.since, now);
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
  return seconds_since(seen.since, now);
}

void HeartbeatWatch::expect(int worker) {
  auto& seen = seen_[worker];
  seen.count = 0;
  seen.since = std::chrono::steady_clock::now();
  seen.expected = true;
}

}  // namespace noloco
