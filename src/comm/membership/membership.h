// Who is in the run: the replicas of one group (all replicas, or the
// replicas of a pipeline stage) as the run's store records them. Deaths are
// declared by the launcher or by a partner that noticed; each outer step's
// members are an agreed snapshot (first writer wins, no barrier); a restarted
// worker is a new incarnation of its rank and asks a live replica for its
// state. Coordination only: the bytes travel by the transport. This is
// torchft's Manager to our ProcessGroup. Thread-safe.
#pragma once
#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "comm/membership/exchange_ranges.h"
#include "comm/membership/heartbeat.h"
#include "comm/membership/liveness.h"
#include "comm/store/store.h"
#include "comm/membership/peer.h"
#include "config/run_layout.h"

namespace noloco {

class Membership final : public Liveness {
 public:
  // Member `rank` of `world` in `scope` of the run. `store` is a connection
  // of its own. Members 0..world−1 are the run's first; a `rank` of `world`
  // or more is a worker that joined later (claim_member_id). A member is
  // given up when its heartbeat is silent for `heartbeat_timeout` or its
  // progress stands still for `idle_timeout` (peer_timeout). `own` (may be
  // null) is this worker's heartbeat, which publishes its progress.
  // `worker_of` names the worker whose heartbeat is a member's (the run's
  // layout: RunLayout::speaker); without it, member r is worker r.
  Membership(StorePtr store, const WorkerEnv& env, const std::string& scope, int rank, int world,
             std::chrono::milliseconds heartbeat_timeout, std::chrono::milliseconds idle_timeout,
             Heartbeat* own = nullptr, std::function<int(int)> worker_of = nullptr);

  int rank() const { return rank_; }
  // The members the run started with (joiners come on top).
  int world() const { return world_; }
  // How many times this rank's worker was started before this one (0: the first start).
  int incarnation() const { return incarnation_; }
  Peer self() const { return {rank_, incarnation_}; }
  // A joiner that has not taken a live replica's state yet: like a restarted
  // worker, it asks for it (request_state), and is in snapshots after rejoined().
  bool joining() const { return joining_; }

  // The members listed under snapshot `name` (an outer step, an evaluation):
  // the first replica to ask writes it from the deaths known then, everyone
  // else reads that one, so all agree even though deaths are noticed at
  // different moments. Sorted by rank. This replica is missing from it when
  // the snapshot was taken while it was thought dead; it then declares
  // itself alive again, for later snapshots.
  std::vector<Peer> snapshot(const std::string& name);
  void declare_dead(int rank) override;
  // Stop waiting for `rank` (waited for since `waiting_since`): declared
  // dead, or its heartbeat has been silent for the heartbeat timeout (a hung
  // process or machine), or it has made no progress for the idle timeout
  // during this wait (stuck). A replica that is merely behind (paused, or
  // busy handing its state over) is waited for: otherwise it would stay
  // behind, given up at every exchange, for the rest of the run.
  bool given_up(int rank, std::chrono::steady_clock::time_point waiting_since) override;
  bool silent(int rank) override;
  // This replica goes to exchange `id` (an outer step's): published with the
  // exchanges it went alone at (unless the store is away), so that a partner
  // still meeting for one of those does not wait for it (after a store
  // outage, replicas that went alone meanwhile are outer steps apart).
  void reach_exchange(int64_t id);
  // This replica goes alone at exchange `id` for want of the store (before
  // or after it came to the meeting); published with the next reach_exchange.
  void go_alone(int64_t id);
  bool went_alone(int rank, int64_t id, bool or_later) override;
  int64_t exchange_reached() override;
  // This replica moved on: an inner step, or a second spent waiting for
  // partners it has not given up (so that those waiting for it wait too).
  void progressed() override {
    if (own_) own_->progressed();
  }

  // A restarted worker: posts its request and waits until a live replica
  // claims it; returns the donor's rank. Throws if none is left to do so.
  int request_state(std::chrono::milliseconds timeout);
  // The hand-over channel of this worker's request (named alike by the donor).
  std::string handover_channel() const;
  // Its state is in place: later snapshots include this incarnation (a
  // joiner: this new member).
  void rejoined();
  // A live replica at inner step `step`: the pending requests it won the
  // claim on, as (rank, channel); each must be served. A renewal's request
  // waits for a replica at or past the step the renewer had reached.
  std::vector<std::pair<int, std::string>> claim_requests(int64_t step);
  // A partner's outer-step message at `outer_step` was refused as diverged:
  // the partner is told (refused_as_diverged) and takes a live replica's state.
  void refuse_as_diverged(const Peer& partner, int64_t outer_step);
  // Whether a partner refused this replica's message of an outer step after
  // the one its last renewal answered.
  bool refused_as_diverged();
  // This replica, alive but diverged, starts over from a live replica's
  // state as a restarted one does (request_state, then rejoined()); until
  // then it is out of snapshots. `outer_step`: the refusals it answers;
  // `step`: the inner step it reached, which its donor must have reached
  // too (a state from behind would have it take part in an outer step twice).
  void renew(int64_t outer_step, int64_t step);
  // This replica has finished training: it serves no more requests. Its
  // summary (JSON; empty: none) is kept in the store for the run's
  // (member_summary), since the machine writing that one may not share a disk with it.
  void finish(const std::string& summary);
  // The other members (joiners in place included) still training: not
  // finished, not declared dead, heartbeat not silent.
  std::vector<int> still_training();
  // This worker was refused at start (its config is not the run's): it is
  // out of every later grouping at once, and the run's summary says `why`
  // (await_member_end) instead of a silent heartbeat.
  void refuse(const std::string& why);
  // This replica leaves the run for good (SIGTERM), in two steps. First
  // begin_leaving(): every snapshot not yet taken leaves it out, while its
  // partners still wait for the exchange it has in flight (a partner that
  // reached the next outer step during that exchange would otherwise group
  // with it once more). Then leave(): partners stop waiting for it and no
  // restarted replica asks it for state. It is finished (finish()) once its
  // summary is written.
  void begin_leaving();
  void leave();

 private:
  std::string request_name() const;
  // Who can be a member: the first `world` ranks and the joiners whose state is in place.
  std::vector<int> candidates() const;
  std::mutex mutex_;
  StorePtr store_;       // the run's store, unprefixed
  StorePtr members_;     // this group's keys
  std::string token_;
  int rank_, world_, incarnation_ = 0;
  int renewals_ = 0;                 // in this incarnation: each one's request has a name of its own
  int64_t refusals_answered_ = -1;   // the last outer step whose refusals a renewal answered
  int64_t renewed_at_step_ = 0;      // the inner step the last renewal started from
  bool joining_ = false;
  std::function<int(int)> worker_of_;
  std::chrono::milliseconds heartbeat_timeout_, idle_timeout_;
  Heartbeat* own_;
  HeartbeatWatch heartbeats_;
  std::chrono::steady_clock::time_point last_dead_read_;
  std::string dead_;  // the dead list as last read
  struct Silence {
    std::chrono::steady_clock::time_point checked, moved;  // moved: when its progress last did
    bool silent = false;                                   // its heartbeat
  };
  std::map<int, Silence> silence_;  // heartbeats and progress are read at most once a second per member
  int64_t exchange_ = -1;           // the exchange this replica last went to
  ExchangeRanges alone_;            // the exchanges this replica went alone at, the latest few
  struct Reached {
    std::chrono::steady_clock::time_point read;
    ExchangeRanges alone;
  };
  std::map<int, Reached> reached_;  // the partners', read at most 4 times a second
  // Its heartbeat and progress, read again if a second has passed. Under mutex_.
  const Silence& silence_of(int rank, std::chrono::steady_clock::time_point now);
  std::set<std::string> seen_requests_;
};

// Who serves each pipeline stage, per step: the live replicas of every
// stage, from the stages' memberships (deaths the launcher declared,
// restarted workers' incarnations) and the losses neighbours noticed, frozen
// under a name (a step) by the first worker to ask, so every worker routes
// that step over the same live workers without a barrier.
struct Roster {
  std::vector<std::vector<Peer>> stages;  // by stage: live replicas (rank = replica), sorted

  bool holds(int stage, const Peer& p) const;
  // Whether each of the run's first `replicas` replicas is live at every
  // stage (workers that joined may come on top).
  bool whole(int replicas) const;
};

// The pipeline's liveness authority, over global worker ranks (replica ·
// stages + stage): the pipeline link asks it before it waits for a
// neighbour and tells it whom it lost, and the rosters it freezes follow
// from what it was told. Thread-safe.
class PipelineRoster final : public Liveness {
 public:
  PipelineRoster(StorePtr store, const std::string& token, int stages, int replicas,
                 std::chrono::milliseconds heartbeat_timeout);
  Roster snapshot(const std::string& name);
  // Given up: declared dead (the launcher's record), lost by a neighbour in
  // the incarnation the last roster lists, left out of the last roster, or
  // its heartbeat silent for the heartbeat timeout. Stores and heartbeats
  // are read at most once a second.
  bool given_up(int worker, std::chrono::steady_clock::time_point waiting_since) override;
  bool silent(int worker) override;
  // A neighbour's pair with `worker` failed: later rosters leave out the
  // incarnation the last roster lists (a restarted one is not affected).
  void declare_dead(int worker) override;
  // The worker's own heartbeat publishes its progress; pipeline waits are not meetings.
  void progressed() override {}

 private:
  struct StageRecord {
    std::chrono::steady_clock::time_point read;
    std::string dead, lost;
  };
  // The roster under `name`, taken (or read) from the store. Under mutex_.
  Roster take_snapshot(const std::string& name);
  // The stage's dead and lost lists, read again if a second has passed. Under mutex_.
  const StageRecord& record_of(int stage);
  // The incarnation of `worker` in the last roster; none if it is not listed (or no roster was taken).
  std::optional<int> listed_incarnation(int worker) const;
  bool silent_locked(int worker);

  std::mutex mutex_;
  StorePtr store_, rosters_;
  std::string token_;
  int stages_, replicas_;
  RunLayout layout_;  // a pipelined replica: one worker a stage
  std::chrono::milliseconds heartbeat_timeout_;
  HeartbeatWatch heartbeats_;
  std::optional<Roster> last_;
  std::map<int, StageRecord> records_;
  std::map<int, std::pair<std::chrono::steady_clock::time_point, bool>> silence_;  // by worker: when read, silent
};

// The step a resumed run continues from, the same for all its workers (a
// worker resumed alone at another step would wait out every exchange): the
// newest step whose checkpoint every worker holds complete, 0 when none holds
// any. `steps_by_worker` lists each worker's complete checkpoints. Throws
// std::runtime_error naming the workers and their newest steps when no step
// is held by all (some hold none, or no step is common).
int64_t choose_resume_step(const std::map<int, std::vector<int64_t>>& steps_by_worker);

// Each of the run's `workers` posts the steps it holds complete and reads
// everyone's; returns choose_resume_step of them (of those that do not start
// from a peer: start_from_peer_on_resume). Gives up (throwing, naming
// who is missing) after `timeout`, or as soon as a missing worker is
// declared dead in its stage's membership.
int64_t agree_resume_step(const StorePtr& store, const std::string& token, int worker, int workers,
                          const RunLayout& layout, const std::vector<int64_t>& steps,
                          std::chrono::milliseconds timeout);

// Before a resumed run starts: worker `worker` holds no checkpoint to resume
// from while others of its stage do (its first checkpoint never finished),
// so it starts as a restarted worker does, from a live replica's state, and
// agree_resume_step leaves it out. For a run that takes back restarted workers.
void start_from_peer_on_resume(const StorePtr& store, const std::string& token, int worker, const RunLayout& layout);

// A new member of `scope` (a worker joining a running run): its rank, the
// first not taken, counted from `world` (the run's first members) up.
int claim_member_id(const StorePtr& store, const std::string& token, const std::string& scope, int world);

// The pipeline stage a new worker joins: the one with the fewest live
// workers (joiners counted from their claim), the first of those on a tie.
int least_served_stage(const StorePtr& store, const std::string& token, int stages, int replicas);

// The members of `scope` that joined the running run and took their state, in the order they did.
std::vector<int> joined_members(const StorePtr& store, const std::string& token, const std::string& scope);

// How member `rank` of `scope` has ended so far: finished (also after
// leaving), or declared dead (a replica leaving is, until it has finished).
enum class MemberState { running, finished, dead };
MemberState member_state(const StorePtr& store, const std::string& token, const std::string& scope, int rank);

// The summary member `rank` of `scope` left at finish(); empty if none.
std::string member_summary(const StorePtr& store, const std::string& token, const std::string& scope, int rank);

// Waits until member `rank` of `scope` (worker `worker`, expected by
// `heartbeats`) has ended: returns nullopt once it finished (also after
// leaving); else why it is not counted as finished: why it was refused at
// start (Membership::refuse), its heartbeat silent
// for `heartbeat_timeout` seconds (a member declared dead alone is still
// waited for: a replica leaving is, while it saves its checkpoint), or what
// `given_up()` says when it says something.
std::optional<std::string> await_member_end(const StorePtr& store, const std::string& token, const std::string& scope,
                                            int rank, int worker, HeartbeatWatch& heartbeats,
                                            double heartbeat_timeout,
                                            const std::function<std::optional<std::string>()>& given_up);


// Records that member `rank` of `scope` is gone (the launcher's view of a failed worker).
void declare_dead(const StorePtr& store, const std::string& token, const std::string& scope, int rank);

}  // namespace noloco
