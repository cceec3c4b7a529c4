// What the live page shows of a run (issue 68), folded from the workers'
// status entries (comm/view/status_board.h) and the membership's verdicts:
// the members as a table, each replica's validation curve, the outer steps'
// pairings and a timeline of starts, joins, hand-overs, leaves and losses.
// A pure state machine: tests tick it with entries and clock readings.
#pragma once
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "comm/view/status_board.h"

namespace noloco {

// One member of a store cluster, as the watcher last reached it.
struct StoreMemberHealth {
  std::string endpoint;
  bool up = false;
  std::string why;  // when down: the error that reaching it gave
};

class RunView {
 public:
  // Seconds on the watcher's own clock: "heard N s ago" needs no agreement between machines.
  void add(const StatusEntry& entry, double now);
  // The run's membership holds member `rank` dead (its launcher saw it
  // die, or its partners gave it up): lost, unless it left or finished.
  void mark_lost(int rank, double now);
  // The identities (rank, replica, stage, stages) of members that may still
  // run: those whose membership is worth asking about.
  std::vector<nlohmann::json> running() const;
  // The store has gone (the run ended, or its host did): the page keeps
  // what it has, and says so.
  void store_gone(const std::string& why);
  void store_back();
  void set_refused(int64_t entries) { refused_ = entries; }
  // A store cluster's members, each up or down (none for a store of one member).
  void set_store_members(std::vector<StoreMemberHealth> members) { store_members_ = std::move(members); }
  // The page's data: {"members", "curves", "spread", "pairings", "timeline", "store"
  // ("live", "finished": gone after every member ended, some finished; else
  // why it cannot be read), "store_members" ([{endpoint, up, why}]), "refused"}.
  nlohmann::json state(double now) const;

 private:
  struct Member {
    nlohmann::json status;
    double heard = 0;
    int lost_incarnation = -1;         // the incarnation found dead; -1: none
    std::vector<nlohmann::json> vals;  // [step, loss, mean_loss or null, bytes]
  };
  void add_event(int rank, const Member& m, int64_t step, const std::string& what, double time);

  std::map<int, Member> members_;
  std::vector<nlohmann::json> pairings_;  // {outer_step, step, replica, stage, with}
  std::vector<nlohmann::json> spread_;    // [step, weight std across replicas]: a drifting run shows here
  std::vector<nlohmann::json> timeline_;  // {time, rank, replica, stage, step, what}
  std::string store_gone_;
  std::vector<StoreMemberHealth> store_members_;
  int64_t refused_ = 0;
};

}  // namespace noloco
