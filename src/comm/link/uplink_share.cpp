#include "comm/link/uplink_share.h"

#include <sys/socket.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

namespace noloco {

UplinkShare::Sending::Sending(UplinkShare* share, int fd) : share_(share), fd_(fd) {
  if (!share_ || share_->bytes_per_second_ <= 0) {
    share_ = nullptr;
    return;
  }
  std::lock_guard<std::mutex> lock(share_->mutex_);
  share_->sending_.push_back(fd_);
  share_->pace_senders();
}

UplinkShare::Sending::~Sending() {
  if (!share_) return;
  std::lock_guard<std::mutex> lock(share_->mutex_);
  auto& s = share_->sending_;
  s.erase(std::find(s.begin(), s.end(), fd_));
  share_->pace_senders();
}

double UplinkShare::each() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return each_locked();
}

double UplinkShare::each_locked() const {
  return sending_.empty() ? bytes_per_second_ : bytes_per_second_ / double(sending_.size());
}

void UplinkShare::pace_senders() {
  if (sending_.empty()) return;
  // The kernel takes the rate as 32 bits of bytes a second (~34 Gbit/s at most).
  const double rate = std::min(each_locked(), double(std::numeric_limits<uint32_t>::max() - 1));
  const auto value = static_cast<unsigned int>(std::max(1.0, std::floor(rate)));
  for (const int fd : sending_) ::setsockopt(fd, SOL_SOCKET, SO_MAX_PACING_RATE, &value, sizeof(value));
}

}  // namespace noloco
