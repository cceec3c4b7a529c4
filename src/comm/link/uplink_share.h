// This machine's upload speed, shared by its links while they send.
//
// Two homes sending to each other at once fill both routers' FIFO uplink
// queues; each direction's acknowledgements then wait behind the other
// direction's data, up to the queue's depth (200 ms on many home routers),
// and TCP's window, grown while the queues were empty, leaves the uplinks
// idle for part of the exchange. A link that leaves at a little under the
// uplink's speed keeps its own router's queue empty, so the other direction's
// acknowledgements pass at once: what home routers' "smart queue" settings
// do, at the 95% their guides advise (docs/several-machines.md has the
// figures). The kernel paces each socket (SO_MAX_PACING_RATE); links sending
// at the same time split the rate evenly.
#pragma once
#include <mutex>
#include <vector>

namespace noloco {

class UplinkShare {
 public:
  // `bits_per_second`: the uplink's speed; 0: links leave at TCP's own pace.
  explicit UplinkShare(double bits_per_second) : bytes_per_second_(kShare * bits_per_second / 8) {}
  UplinkShare(const UplinkShare&) = delete;
  UplinkShare& operator=(const UplinkShare&) = delete;

  // The part of the uplink's speed links may fill together.
  static constexpr double kShare = 0.95;

  // While it lives, the socket `fd` is one of the links sending (a null share: none is paced).
  class Sending {
   public:
    Sending(UplinkShare* share, int fd);
    ~Sending();
    Sending(const Sending&) = delete;
    Sending& operator=(const Sending&) = delete;

   private:
    UplinkShare* share_;
    int fd_;
  };

  // Bytes a second each sending link may leave at now (0: unpaced).
  double each() const;

 private:
  double each_locked() const;  // under mutex_
  void pace_senders();         // under mutex_

  double bytes_per_second_;
  mutable std::mutex mutex_;
  std::vector<int> sending_;
};

}  // namespace noloco
