// Transport over c10d's ProcessGroupGloo (TCP), with the run's store for rendezvous.
//
// Two facts about Gloo shape this class (measured with LibTorch 1.13):
//  - a receive that times out closes its pair for good, and a message larger
//    than the posted buffer aborts the receiving process. So point-to-point
//    exchanges never run on the run-wide group: they use small groups of just
//    the exchanging members, kept for reuse while the same members (in the same
//    incarnations) meet again and thrown away after any failure; and a
//    payload receive is only posted with the size every member agreed on
//    (the config fingerprint checked at join).
//  - a group takes ~25 ms to form and ~10 ms to tear down, against < 1 ms
//    for a small message on a formed one: hence the reuse, and teardown on a
//    background thread.
#pragma once
#include <atomic>
#include <chrono>
#include <functional>
#include <list>
#include <map>
#include <mutex>
#include <set>
#include <memory>
#include <string>
#include <thread>

#include "comm/membership/liveness.h"
#include "comm/transport/gloo_group.h"
#include "comm/store/store.h"
#include "comm/transport/transport.h"
#include "config/worker_env.h"

namespace noloco {

// What a group's sealed collectives bind each member's message to: the run,
// the group, the collective's number in the group (members count them
// alike), its sender and its receiver (-1: all).
struct CollectiveSeal {
  const Seal* seal = nullptr;  // null: in clear
  std::string group;
  int64_t run = 0;
  int64_t count = 0;
  std::vector<uint8_t> context(int64_t kind, int64_t number, int from, int to) const;
};

// The groups of recent point-to-point exchanges, by their members (ranks and
// incarnations), most recently used first; a member's generation names the
// group it holds, so that all members can tell whether they hold the same one.
class P2pGroupCache {
 public:
  explicit P2pGroupCache(std::function<void(GlooGroup)> release);
  ~P2pGroupCache();
  // 0: none held.
  int64_t generation(const std::string& members) const;
  GlooGroup reuse(const std::string& members);
  // Replaces whatever was held for `members`.
  void keep(const std::string& members, int64_t generation, GlooGroup group);
  // After a failure: never used again.
  void forget(const std::string& members);
  void clear();

 private:
  struct Entry {
    std::string members;
    int64_t generation = 0;
    GlooGroup group;
  };
  std::list<Entry>::const_iterator find(const std::string& members) const;
  std::list<Entry>::iterator find(const std::string& members);
  std::function<void(GlooGroup)> release_;
  std::list<Entry> groups_;
};

class GlooTransport final : public Transport {
 public:
  // Member `self` of `world` in `scope` (e.g. "replicas", "stage1").
  // `connect` opens a new connection to the run's store. The run-wide group
  // (collectives) is formed at the first collective, so that a method without
  // any (NoLoCo) never waits for every worker to start; a restarted rank has
  // none: Gloo cannot take it back into a formed group. With `seal`, every
  // payload travels sealed (comm/transport/seal.h), collectives included; null: in clear.
  // `liveness` (may be null: peers are waited for until the timeout) is
  // asked in every wait for a peer and told of every peer given up.
  GlooTransport(std::function<StorePtr()> connect, const WorkerEnv& env, std::string scope, Peer self, int world,
                const std::string& bind, std::chrono::milliseconds timeout, std::shared_ptr<const Seal> seal,
                Liveness* liveness = nullptr);
  ~GlooTransport() override;
  int rank() const override { return self_.rank; }
  int world() const override { return world_; }
  std::vector<std::string> relays_used() const override;
  void all_reduce_mean(torch::Tensor& t) override;
  std::vector<torch::Tensor> all_gather(const torch::Tensor& bytes) override;
  std::vector<torch::Tensor> all_to_all(const torch::Tensor& bytes) override;
  void broadcast(torch::Tensor& t, int root) override;
  ExchangeResult exchange(const ExchangeRequest& request) override;
  void send_state(const std::string& channel, int receiver, const MessageHeader& header,
                  const torch::Tensor& bytes) override;
  torch::Tensor receive_state(const std::string& channel, int donor, const MessageHeader& expected,
                              int64_t max_bytes) override;
  std::unique_ptr<Transport> subgroup(const std::string& name, const std::vector<Peer>& members) override;
  void corrupt_next_message() override { corrupt_next_send_ = true; }

 private:
  // The liveness authority's verdict on `rank`, waited for since `since` (never, without one).
  bool given_up(int rank, std::chrono::steady_clock::time_point since) const;
  // For a wait that every one of `ranks` stands in too (forming a group):
  // tells the authority this worker is waiting, not stuck, and whether any
  // of them is gone (declared dead, heartbeat silent).
  bool any_gone(const std::vector<int>& ranks) const;
  // The same for the two ends of a state hand-over: only a silent heartbeat
  // counts (the receiver is declared dead until it holds the state).
  bool silent(int rank) const;
  // Members meet under `key` through store counters before forming a group:
  // returns the peers that came and were not given up; `late` gets the
  // others, except those that said they stay away (`declined`, if given).
  std::vector<Peer> meet(const std::string& key, const std::vector<Peer>& peers, std::vector<int>* late,
                         int64_t my_generation, std::map<int, int64_t>* generations,
                         std::vector<int>* declined = nullptr);
  // The store's keys where exchanges meet, through `store`.
  StorePtr meeting_room(const StorePtr& store) const;
  // Tells the members meeting under `key` that this one will not come.
  void stay_away(const std::string& key);
  // The group for an exchange among `present` (and this member): the cached
  // one if every member holds it, else a new one; null if it cannot be formed.
  // Formed while none of them is gone. `reused`: whether it was the cached one.
  // `attempt` names a second try of the same exchange apart from the first.
  GlooGroup acquire_group(int64_t exchange, const std::string& planned, bool whole, const std::vector<Peer>& present,
                          const std::map<int, int64_t>& generations, const std::string& attempt, bool* reused);
  // Sends this member's message to each of `present` and receives theirs;
  // true if a pair failed (the group must not be used again).
  bool trade(c10d::ProcessGroupGloo& group, const ExchangeRequest& request, const std::vector<Peer>& present,
             std::chrono::steady_clock::time_point start, ExchangeResult* result, CommStats* cost);
  std::vector<Peer> with_self(std::vector<Peer> peers) const;
  GlooGroup join(const std::string& name, int rank, int world, const std::function<bool()>& abandon = nullptr,
                 PairRoutes* routes = nullptr);
  // How a group just formed went: its share of relayed connections (what a
  // collective's bytes cross), whether each of `members` (the group, in its
  // order; point-to-point messages) is reached through a relay, and the relay used.
  double note_routes(const PairRoutes& routes, const std::vector<Peer>& members);
  // 1 when the pair with `rank` went through a relay when its group was last formed, else 0.
  bool relayed_to(int rank) const;
  // `cost` with the bytes a relay carried counted: `share` of those sent.
  static CommStats relayed(CommStats cost, double share);
  c10d::ProcessGroupGloo& run_group();
  // Destroys groups on a background thread (teardown is slow and off the training path).
  void release(GlooGroup group);

  std::function<StorePtr()> connect_;
  WorkerEnv env_;
  std::string scope_;
  Peer self_;
  int world_;
  std::chrono::milliseconds timeout_;
  int64_t run_id_;
  std::shared_ptr<const Seal> seal_;
  Liveness* liveness_;
  CollectiveSeal run_sealing_;  // the run-wide group's
  std::atomic<bool> corrupt_next_send_{false};
  StorePtr store_;  // exchanges' meetings and groups (one exchange at a time, on whichever thread runs them)
  StorePtr watch_;  // the meeting watchdog's own connection (store_ is blocked in a wait meanwhile)
  std::shared_ptr<gloo::transport::Device> device_;  // one I/O loop for all of this worker's groups
  GlooGroup run_group_;  // formed at the first collective
  double run_group_relayed_ = 0;  // the share of its connections that go through a relay
  mutable std::mutex routes_mutex_;  // exchanges may run on their own thread (overlap=true)
  std::map<int, bool> relayed_to_;  // by peer rank
  std::set<std::string> relays_used_;
  P2pGroupCache p2p_groups_;
  uint64_t relays_lost_seen_ = 0;  // relays_lost() when the cached groups were last trusted
  std::mutex release_mutex_;
  std::thread releasing_;
};

}  // namespace noloco
