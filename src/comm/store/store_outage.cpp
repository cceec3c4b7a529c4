#include "comm/store/store_outage.h"

namespace noloco {

void StoreOutage::unreachable(const std::string& why) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (since_) return;
  since_ = Clock::now();
  why_ = why;
  ++count_;
}

void StoreOutage::reached() {
  std::lock_guard<std::mutex> lock(mutex_);
  ever_reached_ = true;
  if (!since_) return;
  last_ended_ = Clock::now();
  last_seconds_ = std::chrono::duration<double>(last_ended_ - *since_).count();
  total_seconds_ += last_seconds_;
  since_.reset();
  why_.clear();
}

bool StoreOutage::ongoing() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return since_.has_value();
}

bool StoreOutage::ever_reached() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return ever_reached_;
}

std::chrono::duration<double> StoreOutage::seconds() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return since_ ? Clock::now() - *since_ : Clock::duration::zero();
}

std::string StoreOutage::why() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return why_;
}

StoreOutage::Clock::time_point StoreOutage::last_ended() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return last_ended_;
}

double StoreOutage::last_seconds() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return last_seconds_;
}

int StoreOutage::count() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return count_;
}

double StoreOutage::total_seconds() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return total_seconds_ + (since_ ? std::chrono::duration<double>(Clock::now() - *since_).count() : 0.0);
}

StoreOutage& store_outage() {
  static StoreOutage outage;
  return outage;
}

}  // namespace noloco
