// Collectives among a group's members over links (comm/link/), one link to
// each other member: the one collective code we write, because Gloo cannot
// cross NAT. DiLoCo's mean over all replicas and an evaluation's spread run
// here. A mean is a reduce-scatter (each member adds up its slice, in rank
// order) and an all-gather of the slices: 2·(N−1)/N of the buffer on the wire
// per member, as a ring all-reduce, and the same bits on every member. Any
// member's failure fails the collective (throws): a collective needs all.
#pragma once
#include <chrono>
#include <vector>

#include "comm/link/link.h"
#include "comm/transport/transport.h"

namespace noloco {

class LinkCollectives final : public Collectives {
 public:
  // Member `rank` of `links.size()`, links[r] reaching member r (null at `rank`).
  LinkCollectives(std::vector<LinkPtr> links, int rank, int64_t run_id, std::chrono::milliseconds timeout);
  int rank() const override { return rank_; }
  int world() const override { return int(links_.size()); }
  void all_reduce_mean(torch::Tensor& t) override;
  // The run's mesh offers these to the outer methods (Transport); a subgroup does not.
  std::vector<torch::Tensor> all_gather(const torch::Tensor& bytes);
  std::vector<torch::Tensor> all_to_all(const torch::Tensor& bytes);
  void broadcast(torch::Tensor& t, int root) override;
  // Whether every link still works (one that broke fails every later collective).
  bool intact() const;
  const std::vector<LinkPtr>& links() const { return links_; }

 private:
  // Sends `out[r]` to each member r and receives `in[r]` from each (sizes
  // known to both ends), as collective `number`'s piece `kind`; throws naming
  // the first member that failed. Counted into `cost`.
  void trade(int64_t kind, const std::vector<torch::Tensor>& out, std::vector<torch::Tensor>& in, bool send,
             bool receive, const std::vector<bool>& with, CommStats& cost);

  // Sends out[r] to each member r and receives a piece of the same size from each (its own: a copy).
  std::vector<torch::Tensor> pieces(int64_t kind, const std::vector<torch::Tensor>& out, CommStats& cost);
  std::vector<torch::Tensor> to_all(const torch::Tensor& bytes, CommStats& cost);
  std::vector<torch::Tensor> gather(const torch::Tensor& bytes, CommStats& cost);
  void finish(CommStats cost, Clock::time_point start);

  std::vector<LinkPtr> links_;
  int rank_;
  int64_t run_id_;
  std::chrono::milliseconds timeout_;
  int64_t count_ = 0;  // collectives so far: members count them alike
};

}  // namespace noloco
