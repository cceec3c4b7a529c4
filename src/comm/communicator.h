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
  // Mean over `group` (sorted ranks containing rank()) of everyone's `payload`,
  // by point-to-point messages only; sent in the payload's dtype, summed in fp32
  // in rank order so every member computes the same bits. A member that failed
  // or timed out is left out; `arrived` (optional) receives who was counted.
  virtual torch::Tensor group_mean(const torch::Tensor& payload, const std::vector<int>& group,
                                   std::vector<int>* arrived = nullptr) = 0;

  // Replicas that take part in outer step `outer_step`: the same answer on
  // every replica that asks (an agreed snapshot), without the ones known dead.
  virtual std::vector<int> members(int64_t /*outer_step*/) {
    std::vector<int> all(static_cast<size_t>(world()));
    for (int r = 0; r < world(); ++r) all[size_t(r)] = r;
    return all;
  }

  // Traffic is charged to training or, inside an EvaluationTraffic scope, to evaluation.
  const CommStats& stats() const { return training_; }
  const CommStats& evaluation_stats() const { return evaluation_; }

  class EvaluationTraffic {
   public:
    explicit EvaluationTraffic(Communicator& c) : c_(c) { c_.current_ = &c_.evaluation_; }
    ~EvaluationTraffic() { c_.current_ = &c_.training_; }

   private:
    Communicator& c_;
  };

 protected:
  CommStats& charge() { return *current_; }

 private:
  CommStats training_, evaluation_;
  CommStats* current_ = &training_;
};

}  // namespace noloco
