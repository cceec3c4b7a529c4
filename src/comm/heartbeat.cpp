#include "comm/heartbeat.h"

#include <fmt/format.h>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

namespace noloco {

std::string heartbeat_key(const std::string& token, int worker) {
  return fmt::format("noloco/{}/heartbeat/{}", token, worker);
}

Heartbeat::Heartbeat(const WorkerEnv& env, std::chrono::milliseconds period) {
  // Its own connection: the training thread's store calls may block (waits).
  c10d::TCPStoreOptions opts;
  opts.port = uint16_t(env.master_port);
  opts.isServer = false;
  auto store = c10::make_intrusive<c10d::TCPStore>(env.master_addr, opts);
  const auto key = heartbeat_key(env.token, env.rank);
  store->add(key, 1);
  thread_ = std::thread([this, store, key, period] {
    std::unique_lock<std::mutex> lock(mutex_);
    while (!wake_.wait_for(lock, period, [this] { return stop_; })) {
      try {
        store->add(key, 1);
      } catch (const std::exception&) {
        return;  // the store is gone: the run is over
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

HeartbeatWatch::HeartbeatWatch(c10::intrusive_ptr<c10d::Store> store, std::string token)
    : store_(std::move(store)), token_(std::move(token)) {}

double HeartbeatWatch::silent_seconds(int worker) {
  const auto now = std::chrono::steady_clock::now();
  const int64_t count = store_->add(heartbeat_key(token_, worker), 0);
  auto& seen = seen_[worker];
  if (count != seen.count || count == 0) {
    seen = {count, now};
    return 0;
  }
  return std::chrono::duration<double>(now - seen.since).count();
}

void HeartbeatWatch::reset(int worker) { seen_.erase(worker); }

}  // namespace noloco
