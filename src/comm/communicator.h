// What the outer methods need from the network, and what they are charged for it.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
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

// Training state handed by a live replica to a restarted one.
struct PeerState {
  int donor = -1;
  int64_t step = 0;        // inner steps done
  int64_t adam_steps = 0;  // AdamW's step counter
  torch::Tensor values;    // flat fp32; see train/peer_state.h for the layout
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
  // in rank order so every member computes the same bits. `exchange` names the
  // exchange identically on all members (NoLoCo: the outer step). A member that
  // failed or timed out is left out; `arrived` (optional) receives who was counted.
  virtual torch::Tensor group_mean(const torch::Tensor& payload, const std::vector<int>& group, int64_t exchange,
                                   std::vector<int>* arrived = nullptr) = 0;

  // Replicas that take part in outer step `outer_step`: the same answer on
  // every replica that asks (an agreed snapshot), without the ones known dead.
  // This replica is missing from it when the snapshot was taken while it was
  // thought dead (restarted, or too slow); it then averages alone this time.
  virtual std::vector<int> members(int64_t /*outer_step*/) {
    std::vector<int> all(static_cast<size_t>(world()));
    for (int r = 0; r < world(); ++r) all[size_t(r)] = r;
    return all;
  }

  // Rejoin: how many times this replica's worker was started before (0: the first start).
  virtual int incarnation() const { return 0; }
  // A restarted replica: waits for a live one to hand over its state of
  // `numel` values. Throws if no live replica is left to do so.
  virtual PeerState receive_state(int64_t /*numel*/) {
    throw std::runtime_error("this communicator cannot rejoin a run");
  }
  // A live replica after an outer step: hands its state to the restarted
  // replicas waiting for one (those it wins the claim on); `pack` builds the
  // state only if one is waiting. Returns the replicas it served.
  virtual std::vector<int> serve_rejoins(int64_t /*step*/, int64_t /*adam_steps*/,
                                         const std::function<torch::Tensor()>& /*pack*/) {
    return {};
  }
  // This replica has finished training: it will serve no more rejoins.
  virtual void finish() {}

  // An evaluation-only group of the replicas alive at `step` (an agreed
  // snapshot), for collectives among just them, so the run-wide metrics
  // survive deaths and rejoins; null where none can be formed. Its traffic is
  // its own, not training's.
  virtual std::unique_ptr<Communicator> live_group(int64_t /*step*/) { return nullptr; }

  const CommStats& stats() const { return stats_; }

 protected:
  CommStats& charge() { return stats_; }

 private:
  CommStats stats_;
};

}  // namespace noloco
