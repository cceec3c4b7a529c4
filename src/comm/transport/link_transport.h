// Moving tensors between the replicas of one group (all replicas, or those
// of one pipeline stage) over links (comm/link/): the outer exchanges, the
// hand-over of a state to a restarted or joining replica, and collectives
// (DiLoCo's mean, an evaluation's spread) over a mesh of links. What crosses
// between sites crosses here; Gloo stays inside a replica (gloo_transport.h).
//
// An exchange's members first meet in the run's store (meeting.h): each says
// it came, and names the link it holds to each of the others. Each pair then
// uses that link if both ends hold it, or opens a new one (direct, punched
// or relayed, as the endpoint finds a way), and trades its messages both
// ways at once, every pair of the group at the same time. A member that does
// not come, or whose message fails, is lost, and the liveness authority is
// told. A link through a relay that broke says nothing of the peer (its relay
// may be gone): those pairs meet again and trade over a new link.
#pragma once
#include <atomic>
#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>

#include "comm/link/link_book.h"
#include "comm/membership/liveness.h"
#include "comm/store/store.h"
#include "comm/transport/link_collectives.h"
#include "comm/transport/meeting.h"
#include "comm/transport/transport.h"
#include "config/worker_env.h"

namespace noloco {

class LinkTransport final : public Transport {
 public:
  // Member `self` of `world` in `scope` (e.g. "replicas/stage0"), its links
  // starting at `endpoint`. `connect` opens a new connection to the run's
  // store. `liveness` (may be null: peers are waited for until the timeout)
  // is asked in every wait for a peer and told of every peer given up.
  LinkTransport(std::function<StorePtr()> connect, const WorkerEnv& env, std::string scope, Peer self, int world,
                std::shared_ptr<LinkEndpoint> endpoint, std::chrono::milliseconds timeout,
                Liveness* liveness = nullptr);
  ~LinkTransport() override;
  int rank() const override { return self_.rank; }
  int world() const override { return world_; }
  std::vector<std::string> relays_used() const override;
  std::map<int, LinkRoute> routes() const override;
  // Collectives among all `world` members, over a mesh formed at the first.
  void all_reduce_mean(torch::Tensor& t) override;
  std::vector<torch::Tensor> all_gather(const torch::Tensor& bytes) override;
  std::vector<torch::Tensor> all_to_all(const torch::Tensor& bytes) override;
  void broadcast(torch::Tensor& t, int root) override;
  ExchangeResult exchange(const ExchangeRequest& request) override;
  void send_state(const std::string& channel, int receiver, const MessageHeader& header,
                  const torch::Tensor& bytes) override;
  torch::Tensor receive_state(const std::string& channel, int donor, const MessageHeader& expected,
                              int64_t max_bytes) override;
  std::unique_ptr<Collectives> subgroup(const std::string& name, const std::vector<Peer>& members) override;
  void corrupt_next_message() override { corrupt_next_send_ = true; }
  // A test's slow machine: `hook` runs once, on the trading thread, after the
  // next exchange's links opened and before its messages go.
  void before_next_trade(std::function<void()> hook) { before_next_trade_ = std::move(hook); }

 private:
  struct Failure {
    Peer peer;
    bool retry;  // its link broke through a relay: the relay may be gone, not the peer
  };
  LinkEnd end_of(const LinkBook& book, const Peer& p) const { return {book.self().scope, p.rank, p.incarnation}; }
  bool given_up(int rank, Clock::time_point since) const;
  // Whether any of `ranks` is given up, or went alone at `exchange` (none: at
  // the exchange last reached, or later).
  bool any_gone(const std::vector<int>& ranks, std::optional<int64_t> exchange = std::nullopt) const;
  bool silent(int rank) const;
  // The links of `book` to each of `peers` at once (null where none came,
  // with its problem): held ones where `theirs` names them.
  std::vector<LinkPtr> open_links(LinkBook& book, const std::vector<Peer>& peers, const std::map<int, int64_t>& theirs,
                                  const std::string& attempt, const std::function<bool(int)>& abandon,
                                  std::vector<std::string>* problems);
  // Collectives over links to each of `members` (sorted, this one among them); throws naming one that failed.
  std::unique_ptr<LinkCollectives> form_mesh(LinkBook& book, const std::vector<Peer>& members,
                                             const std::string& attempt);
  LinkCollectives& run_mesh();
  template <class Op>
  auto on_run_mesh(Op op);
  // Sends this member's message to each of `present` and receives theirs,
  // over links opened (or reused) for `attempt`; returns the peers that failed.
  std::vector<Failure> trade(const ExchangeRequest& request, const std::vector<Peer>& present,
                             const std::map<int, int64_t>& theirs, const std::string& attempt,
                             Clock::time_point start, ExchangeResult* result, CommStats* cost);
  LinkPtr handover_link(const std::string& channel, int peer, const char* role);

  std::function<StorePtr()> connect_;
  WorkerEnv env_;
  std::string scope_;
  Peer self_;
  int world_;
  std::shared_ptr<LinkEndpoint> endpoint_;
  std::chrono::milliseconds timeout_;
  int64_t run_id_;
  Liveness* liveness_;
  std::atomic<bool> corrupt_next_send_{false};
  std::function<void()> before_next_trade_;
  Meeting meeting_;
  LinkBook exchanges_;  // exchanges (one at a time, on whichever thread runs them)
  LinkBook handovers_;  // state hand-overs: a link of their own, beside a pair's exchanges
  LinkBook meshes_;     // the run-wide collectives
  LinkBook groups_;     // subgroups' collectives
  std::unique_ptr<LinkCollectives> run_mesh_;
  int64_t meshes_formed_ = 0;
};

}  // namespace noloco
