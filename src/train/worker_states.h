// A worker's life in a run as one machine of named states. WorkerLife (the
// CLI's loop and the Python door alike) reports what happened, with the time
// in seconds on any clock, and does what the machine answers; the machine
// holds no clock and does no I/O, so tests tick it with invented times.
//
//   starting --first start / resume-----------------------------> training
//   starting --restarted or joining--> joining --state taken----> training
//   starting --restarted or joining, where the run cannot take it--> refused
//   training --a partner refused its message as diverged--> renewing
//   renewing --a live replica's state taken---------------------> training
//   training --SIGTERM, where a worker may leave----------------> left
//   training --the store silent past store_outage---------------> ended_without_store
//   training --the last step------------------------------------> finished
//
// At the last step it finishes whatever else happened: what is in flight is
// applied there anyway, and leaving or ending a step early gains nothing.
#pragma once
#include <cstdint>
#include <optional>

namespace noloco {

enum class LifeState { starting, joining, training, renewing, left, ended_without_store, finished, refused };
const char* life_state_name(LifeState s);

// What the worker does next (refuse: it cannot take part, and ends with an error).
enum class LifeAction { take_live_state, refuse, train_on, renew, leave, end_without_store, finish };

// The run's rules for this worker (from its config and place).
struct LifeRules {
  bool takes_back = false;  // a restarted or joining worker may take a live replica's state
  bool renews = false;      // a replica a partner refused as diverged takes a live replica's state
  // A store silent this long (seconds) ends the worker with its checkpoint;
  // unset: it trains on alone however long (the Python door: the user's loop owns its end).
  std::optional<double> store_outage;
};

// What happened by the end of one inner step (and its outer step, if one was due).
struct StepFacts {
  bool last = false;         // the run's last step
  bool diverged = false;     // a partner refused this replica's message as diverged
  bool leave_asked = false;  // SIGTERM, where a worker may leave
  double store_silent_for = 0;  // seconds the store has not answered (0: its last request was answered)
};

// What the machine noticed of the store at a tick, for the worker to say.
enum class StoreNews { none, went_silent, answers_again };

struct LifeVerdict {
  LifeAction action = LifeAction::train_on;
  StoreNews store = StoreNews::none;
};

class WorkerStates {
 public:
  explicit WorkerStates(LifeRules rules) : rules_(rules) {}

  // At start: `from_live_state` (restarted by its launcher, or joining).
  LifeAction start(bool from_live_state);
  // The live replica's state taken (joining or renewing): training again.
  void state_taken();
  // After an inner step at time `now`.
  LifeVerdict after_step(double now, const StepFacts& facts);

  LifeState state() const { return state_; }
  // While the store is silent: since when.
  std::optional<double> store_silent_since() const { return silent_since_; }

 private:
  LifeRules rules_;
  LifeState state_ = LifeState::starting;
  std::optional<double> silent_since_;
};

}  // namespace noloco
