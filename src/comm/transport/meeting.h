// Where the members of an exchange meet before they trade, in the run's
// store: each says it came, and which link it holds to each of the others,
// so that a pair reuses a link only when both ends hold the same one.
//
// Each member adds `came` to its own counter under the exchange's key and
// blocks until every peer's counter exists: event-driven, so members meet as
// soon as all are there. A watchdog on its own store connection adds
// `given_up` to the counter of a peer that is given up or has not come within
// the timeout, which wakes the wait. A counter of exactly `came` means "came,
// and not given up"; a member that finds more on arriving was given up and
// goes on alone; one that will not come adds `stays_away` to its own (it is
// alive: not late). Counters, not compareSet: the store wakes waiters on
// add, not on compareSet. With a liveness authority the wait is patient,
// without a deadline: the authority decides, and is told about once a
// second that this member is waiting, not stuck (for the members waiting for it).
//
// With a partner wait (partner_wait=S, issue 105), a peer alive but not come
// within S is left behind the same way (given_up added to its counter) but
// not blamed: it is not lost, and on arriving it goes on alone, its work
// taken at its next meeting. A peer may come just before the give-up lands;
// the counter (came + given_up) cannot tell the order, so each member with a
// partner wait writes what it found on arriving, and a reader of such a
// counter asks that.
#pragma once
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "comm/membership/liveness.h"
#include "comm/membership/peer.h"
#include "comm/store/store.h"

namespace noloco {

// What a member's counter at a meeting says.
enum class Arrival : int64_t {
  came = 1,
  given_up = 2,    // added by a peer's watchdog (came, then given up: 3)
  stays_away = 4,  // and up: said it will not come
};

struct MeetingOutcome {
  std::vector<Peer> present;        // came, not given up
  std::vector<int> late;            // did not come in time, or given up
  std::vector<int> behind;          // alive, left behind after the partner wait: not lost
  bool left_behind = false;         // this member came after its peers had left it behind
  std::map<int, std::vector<uint8_t>> notes;  // left behind: what the peers that had come noted
  std::vector<int> declined;        // said they stay away
  std::map<int, int64_t> theirs;    // of those present: the id of the link each holds to this member (0: none)
};

// The meeting's decisions, apart from the store: Meeting (below) reads the
// counters, hands them to it and does what it says; tests tick it alone.
//   announcing --arrived(came)--> waiting --decide--> met
//   announcing --arrived(more)--> alone   (given up before it came)
class MeetingProtocol {
 public:
  using Clock = std::chrono::steady_clock;
  enum class State { announcing, waiting, alone, met };
  // What this member reads of a peer once every peer's counter exists.
  struct Reading {
    int64_t counter = 0;
    std::optional<int64_t> link_to_me;  // absent: the peer did not meet this member
    // Asked where verdict_needed(counter): it came before it was left behind.
    bool came_first = false;
  };

  // Meeting `peers` from `start`: without patience (no liveness authority),
  // a peer not come within `timeout` is given up; with it, only a peer the
  // authority gives up is, or (with `partner_wait` > 0) one not come within
  // it, which is left behind.
  MeetingProtocol(std::vector<int> peers, Clock::time_point start, std::chrono::milliseconds timeout, bool patient,
                  std::chrono::milliseconds partner_wait = std::chrono::milliseconds(0));
  State state() const { return state_; }
  // This member's own counter, once it added `came` to it.
  void arrived(int64_t own_counter);
  // A watchdog's tick at `now`: the peers, not come yet, to give up
  // (`given_up_by_authority` asks the liveness authority).
  std::vector<int> overdue(Clock::time_point now, const std::function<bool(int)>& come,
                           const std::function<bool(int)>& given_up_by_authority) const;
  // Whether to tell the authority, at `now`, that this member waits (not stuck): about once a second.
  bool tell_waiting(Clock::time_point now);
  // Whether a peer's counter says both came and left behind, in an order the peer alone knows.
  bool verdict_needed(int64_t counter) const;
  // Every peer's counter exists: who came, who is late, who declined, who
  // is left behind (not come, and not given up by the authority).
  MeetingOutcome decide(const std::vector<Peer>& peers, const std::map<int, Reading>& readings,
                        const std::function<bool(int)>& given_up_by_authority = nullptr);

 private:
  std::vector<int> peers_;
  Clock::time_point start_, told_;
  std::chrono::milliseconds timeout_, partner_wait_;
  bool patient_;
  State state_ = State::announcing;
};

class Meeting {
 public:
  // Member `self` of the group `scope` names, in the run `token` names.
  Meeting(std::function<StorePtr()> connect, const std::string& token, const std::string& scope, int self,
          std::chrono::milliseconds timeout, Liveness* liveness);
  // Meets `peers` under `key`, for exchange `exchange`, announcing `mine`
  // (by peer rank: the link this member holds to it). With a partner wait
  // (> 0 on every member of the run, or on none), `note` goes with what it
  // found on arriving, for a peer left behind.
  MeetingOutcome meet(const std::string& key, int64_t exchange, const std::vector<Peer>& peers,
                      const std::map<int, int64_t>& mine, const std::vector<uint8_t>& note = {},
                      std::chrono::milliseconds partner_wait = std::chrono::milliseconds(0));
  // Tells the members meeting under `key` that this one will not come.
  void stay_away(const std::string& key);

 private:
  // Whether `peer`, whose counter says came and left behind, came first (its own word).
  bool came_first(const std::string& key, int peer);
  // Left behind: the notes of the peers that had come.
  std::map<int, std::vector<uint8_t>> notes_of(const std::string& key, const std::vector<Peer>& peers);
  std::function<StorePtr()> connect_;
  std::string token_, scope_;
  int self_;
  std::chrono::milliseconds timeout_;
  Liveness* liveness_;
  StorePtr room_;   // one meeting at a time, on whichever thread runs the exchanges
  StorePtr watch_;  // the watchdog's own connection (room_ is blocked in a wait meanwhile)
};

}  // namespace noloco
