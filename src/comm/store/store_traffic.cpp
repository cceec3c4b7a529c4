#include "comm/store/store_traffic.h"

#include <atomic>

namespace noloco {

namespace {

std::atomic<uint64_t> requests{0}, bytes_read{0};
thread_local bool clocked = false;

}  // namespace

void count_store_request(uint64_t bytes) {
  if (clocked) return;
  requests.fetch_add(1, std::memory_order_relaxed);
  bytes_read.fetch_add(bytes, std::memory_order_relaxed);
}

StoreTraffic store_traffic() {
  return {requests.load(std::memory_order_relaxed), bytes_read.load(std::memory_order_relaxed)};
}

void count_this_thread_as_clocked() { clocked = true; }

}  // namespace noloco
