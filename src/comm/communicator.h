// What the outer methods need from the network, and what they are charged for it.
#pragma once
#include <cstdint>
#include <vector>

#include <torch/torch.h>

namespace noloco {

struct CommStats {
  uint64_t bytes_sent = 0, bytes_received = 0;
  double comm_seconds = 0;  // inside communication calls, waiting included
  double wait_seconds = 0;  // of which blocked on peers (time until their data arrived)
  int64_t collectives = 0;  // all-reduce and other collective calls
  int64_t messages = 0;     // point-to-point sends
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int world() const = 0;
  // In-place mean over all replicas: one collective.
  virtual void all_reduce_mean(torch::Tensor& t) = 0;
  // In-place mean over `group` (sorted ranks containing rank()), by point-to-point
  // messages only. Returns the members whose data arrived (always including rank());
  // a member that failed or timed out is left out of the mean.
  virtual std::vector<int> group_mean(torch::Tensor& t, const std::vector<int>& group) = 0;
  const CommStats& stats() const { return stats_; }
  CommStats& stats() { return stats_; }

 protected:
  CommStats stats_;
};

}  // namespace noloco
