// Framed point-to-point messages among a changing set of workers: those the
// caller's rosters list, over a Gloo group formed anew whenever a roster
// lists someone the current group lacks. Bytes only: what a message means is
// the caller's (the pipeline's channel, in pipeline/), as outer messages are
// the outer methods'. Each directed pair counts its messages identically at
// both ends: their tags.
//
// A peer is lost when its pair fails (PeerLink tells the liveness authority
// itself when a send fails; the caller, through lose(), when a receive comes
// back peer_lost or unauthentic, naming what did not come), so what one path
// gave up, the next roster leaves out. Sends to a lost peer are dropped;
// receives from it come back peer_lost at once. A receive asks the authority
// first and does not wait for a peer it gave up.
#pragma once
#include <chrono>
#include <functional>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "comm/membership/liveness.h"
#include "comm/membership/peer.h"
#include "comm/store/store.h"
#include "comm/transport/framed.h"
#include "comm/transport/gloo_admission.h"
#include "comm/transport/gloo_group.h"

namespace noloco {

class Seal;

class PeerLink {
 public:
  // Worker `self` (its global rank and incarnation) of the run `env` names;
  // its peers are called `peers_name` in the log ("pipeline worker"). With
  // `seal`, every payload travels sealed (comm/transport/seal.h); null: in clear.
  PeerLink(std::string peers_name, StorePtr store, const WorkerEnv& env, Peer self, const std::string& bind,
           std::chrono::milliseconds timeout, std::shared_ptr<const Seal> seal, Liveness& liveness);
  ~PeerLink();
  PeerLink(const PeerLink&) = delete;
  PeerLink& operator=(const PeerLink&) = delete;

  // Every worker of `members` (global ranks, this one among them) calls this
  // with the same `name`: unless the current group holds each of them already,
  // what is in flight is finished and they form a new group.
  void form(const std::string& name, const std::vector<Peer>& members);

  // Starts sending `parts` (CPU, contiguous; at most `kMaxParts`, of
  // `header.bytes` in all) under `header` to worker `peer`; false when the
  // peer is lost (nothing is sent).
  static constexpr int kMaxParts = 2;
  bool send(int peer, const MessageHeader& header, std::vector<torch::Tensor> parts);
  // Receives what `expected` announces from worker `peer` into `parts` (CPU,
  // preallocated to the announced size). Unless received or dropped,
  // `problem` says why.
  Delivery receive(int peer, const MessageHeader& expected, std::vector<torch::Tensor>& parts, std::string& problem);
  // Gives worker `peer` up (and tells the liveness authority): `why` is logged.
  void lose(int peer, const std::string& why);
  // Waits until every send has left (or its peer is lost); call before the
  // sent tensors are reused.
  void finish_sends();

  // Whether the pair with worker `peer` went through a relay (issue 66).
  bool relayed(int peer) const;
  const Peer& self() const { return self_; }
  int64_t run_id() const { return run_id_; }
  int64_t peers_lost() const { return peers_lost_; }

 private:
  // The group rank of worker `peer`; -1 if it is not in the group or is lost.
  int member_of(int peer) const;
  int next_tag(std::vector<int64_t>& counters, int member) const;

  std::string peers_name_;
  StorePtr store_;
  WorkerEnv env_;
  Peer self_;
  std::chrono::milliseconds timeout_;
  int64_t run_id_;
  std::shared_ptr<const Seal> seal_;
  Liveness& liveness_;
  std::shared_ptr<gloo::transport::Device> device_;
  GlooGroup group_;
  std::vector<GlooGroup> retired_;  // earlier groups: peers may still be reading from them
  std::vector<Peer> members_;       // of group_, by group rank (rank: global worker rank)
  PairRoutes routes_;               // of group_'s pairs
  std::set<int> lost_;              // global ranks lost in this group
  std::vector<int64_t> sent_to_, received_from_;  // messages per directed pair, by group rank
  struct Pending {
    int peer;
    std::function<void()> wait;  // keeps its tensors alive
  };
  std::vector<Pending> pending_;
  int64_t peers_lost_ = 0;
};

}  // namespace noloco
