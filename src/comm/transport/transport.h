// Moving tensors between the replicas of one group (all replicas, or the
// replicas of one pipeline stage): collectives for the all-reduce methods,
// point-to-point exchanges for NoLoCo, and the hand-over of a replica's state
// to a restarted one. Data only: who is alive is membership's business
// (comm/membership/membership.h). Swappable, as torchft's process groups are.
#pragma once
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "comm/link/link.h"
#include "comm/membership/peer.h"
#include "comm/transport/comm_stats.h"
#include "wire/message.h"

namespace noloco {

// One point-to-point exchange among `group` (sorted, this member included):
// `payload` (uint8, CPU) goes to every other member, preceded by `header`;
// each peer's message must carry the same header but for the sender.
struct ExchangeRequest {
  int64_t id = 0;  // names the exchange identically on all members
  std::vector<Peer> group;
  MessageHeader header;  // header.bytes == payload.numel(); the transport stamps header.run
  torch::Tensor payload;
  // > 0: a peer alive but not come within it is left behind, not waited for
  // (comm/transport/meeting.h); the same sign on every member of the run.
  std::chrono::milliseconds partner_wait{0};
  // With a partner wait: a few bytes the peers read at the meeting even where
  // they were left behind and receive no payload (pace=speed: the sender's PaceReport).
  std::vector<uint8_t> note;
};

struct ExchangeResult {
  std::map<int, torch::Tensor> received;  // by rank: the payloads that came and passed the header check
  std::vector<int> lost;                  // peers given up, failed or rejected
  std::vector<int> behind;                // peers alive but late past the partner wait: left behind, not lost
  bool left_behind = false;  // this member came after its peers had left it behind (the partner wait)
  std::map<int, std::vector<uint8_t>> notes;  // left behind: the notes of the peers that had come, by rank
};

// The collectives every group of ours has: the replicas of a stage (under
// Transport, below), a replica's own workers (Gloo, or NCCL on a node's
// GPUs), an evaluation's live replicas (Transport::subgroup).
class Collectives {
 public:
  virtual ~Collectives() = default;
  virtual int rank() const = 0;
  virtual int world() const = 0;
  // In-place mean over all members: one collective.
  virtual void all_reduce_mean(torch::Tensor& t) = 0;
  // `t` (any device) from member `root` to every member, in place: one collective.
  virtual void broadcast(torch::Tensor& t, int root) = 0;

  // What its traffic cost so far. Exchanges may run on a background thread
  // (overlap=true) while the training thread reads this.
  CommStats stats() const {
    std::lock_guard<std::mutex> lock(stats_mutex_);
    return stats_;
  }

 protected:
  void charge(const CommStats& cost) {
    std::lock_guard<std::mutex> lock(stats_mutex_);
    stats_ += cost;
  }

 private:
  mutable std::mutex stats_mutex_;
  CommStats stats_;
};

// Among the replicas of one stage: the outer methods' collectives and
// exchanges, and the hand-over of a replica's state.
class Transport : public Collectives {
 public:
  // Every member's `bytes` (uint8, the same size everywhere), in rank order: one collective.
  virtual std::vector<torch::Tensor> all_gather(const torch::Tensor& bytes) = 0;
  // `bytes` (uint8) cut into world() equal chunks, chunk r going to member r;
  // returns the chunks addressed to this member, in rank order: one collective.
  virtual std::vector<torch::Tensor> all_to_all(const torch::Tensor& bytes) = 0;
  // Point-to-point only; never throws for a peer's failure (it is `lost`,
  // and declared dead to the transport's liveness authority, if it has one).
  // With one, peers are waited for until it gives them up (it tells a stuck
  // peer from one that is behind); without, for the transport's timeout.
  virtual ExchangeResult exchange(const ExchangeRequest& request) = 0;
  // The hand-over of a training state on `channel` (named identically by both
  // ends): the donor sends to member `receiver`, the restarted member
  // receives from member `donor` a payload of at most `max_bytes` after
  // checking its header (the transport stamps `run`; the size is the
  // header's). Throw on failure, at once when the liveness authority gives
  // the other end up.
  virtual void send_state(const std::string& channel, int receiver, const MessageHeader& header,
                          const torch::Tensor& bytes) = 0;
  virtual torch::Tensor receive_state(const std::string& channel, int donor, const MessageHeader& expected,
                                      int64_t max_bytes) = 0;
  // Collectives among just `members` (sorted; this member included), for
  // evaluations across the live replicas; its traffic is its own. Forming
  // it throws at once when the liveness authority gives a member up.
  virtual std::unique_ptr<Collectives> subgroup(const std::string& name, const std::vector<Peer>& members) = 0;
  // A failure drill (inject_crash=RANK:STEP:corrupt): one byte of this
  // member's next exchange message is flipped on the wire.
  virtual void corrupt_next_message() {}

  // The relays (host:port) its links went through so far.
  virtual std::vector<std::string> relays_used() const { return {}; }
  // The route of the link to each peer it exchanged with (by rank), as last opened.
  virtual std::map<int, LinkRoute> routes() const { return {}; }
};

}  // namespace noloco
