// Framed point-to-point messages among a changing set of workers (the
// pipeline's stage workers, in any homes): those the caller's rosters list,
// each pair over a link of its own (comm/link/), opened when the pair first
// needs it. Bytes only: what a message means is the caller's (the
// pipeline's channel, in pipeline/), as outer messages are the outer
// methods'. A pair's messages in each direction arrive in the order they
// were sent, and each end sends and receives them in the same order.
//
// A peer is lost when its link fails (PeerLink tells the liveness authority
// itself when a send fails; the caller, through lose(), when a receive comes
// back peer_lost or unauthentic, naming what did not come), so what one path
// gave up, the next roster leaves out. Sends to a lost peer are dropped;
// receives from it come back peer_lost at once. A receive from a peer whose
// link is not open yet asks the authority first and does not wait for a peer
// it gave up; over an open link it reads what the peer sent before it went.
#pragma once
#include <atomic>
#include <chrono>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "comm/link/link_book.h"
#include "comm/membership/liveness.h"
#include "comm/membership/peer.h"
#include "comm/store/store.h"
#include "comm/transport/link_messages.h"

namespace noloco {

class PeerLink {
 public:
  // Worker `self` (its global rank and incarnation) of the run `env` names,
  // its links starting at `endpoint`, its addresses published through
  // `store` (a connection of its own: links open on other threads); its
  // peers are called `peers_name` in the log ("pipeline worker").
  PeerLink(std::string peers_name, StorePtr store, const WorkerEnv& env, Peer self,
           std::shared_ptr<LinkEndpoint> endpoint, std::chrono::milliseconds timeout, Liveness& liveness);
  ~PeerLink();
  PeerLink(const PeerLink&) = delete;
  PeerLink& operator=(const PeerLink&) = delete;

  // Every worker of `members` (global ranks, this one among them) calls this
  // with the same `name`: unless each of them is known already, what is in
  // flight is finished, the lost are forgiven, and links open anew under `name`.
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

  // Of the payload bytes of training messages sent (not evaluations'), those
  // whose link went through a relay, or through a punched hole.
  struct Routed {
    uint64_t relayed = 0, punched = 0;
  };
  Routed routed() const { return {relayed_bytes_, punched_bytes_}; }
  const Peer& self() const { return self_; }
  int64_t run_id() const { return run_id_; }
  int64_t peers_lost() const { return peers_lost_; }

 private:
  // The link to `peer` (a member), opened if none works; null if none came, with `problem`.
  LinkPtr link_of(const Peer& peer, std::string* problem);
  const Peer* member(int peer) const;  // null if not a member, or lost

  std::string peers_name_;
  Peer self_;
  std::chrono::milliseconds timeout_;
  int64_t run_id_;
  Liveness& liveness_;
  LinkBook book_;
  std::string name_;           // of the current membership: the links' attempt
  std::vector<Peer> members_;  // (rank: global worker rank)
  std::set<int> lost_;         // global ranks lost since the last form
  mutable std::mutex open_mutex_;  // opening a pair's link: a send's thread and a receive may both ask
  std::map<int, std::unique_ptr<std::mutex>> opening_;
  // Each peer's last send in flight (each waits for the one before it: a
  // pair's messages leave in order); what it returns is its problem ("" none).
  std::map<int, std::shared_future<std::string>> sending_;
  int64_t peers_lost_ = 0;
  std::atomic<uint64_t> relayed_bytes_{0}, punched_bytes_{0};  // counted on the sending threads
};

}  // namespace noloco
