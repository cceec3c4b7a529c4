#include "train/worker_states.h"

#include <stdexcept>
#include <string>

namespace noloco {

const char* life_state_name(LifeState s) {
  switch (s) {
    case LifeState::starting: return "starting";
    case LifeState::joining: return "joining";
    case LifeState::training: return "training";
    case LifeState::renewing: return "renewing";
    case LifeState::left: return "left";
    case LifeState::ended_without_store: return "ended_without_store";
    case LifeState::finished: return "finished";
    case LifeState::refused: return "refused";
  }
  return "starting";
}

namespace {
void expect(LifeState actual, LifeState expected, const char* event) {
  if (actual != expected)
    throw std::logic_error(std::string(event) + " in state " + life_state_name(actual) + ", not " +
                           life_state_name(expected));
}
}  // namespace

LifeAction WorkerStates::start(bool from_live_state) {
  expect(state_, LifeState::starting, "start");
  if (!from_live_state) {
    state_ = LifeState::training;
    return LifeAction::train_on;
  }
  if (!rules_.takes_back) {
    state_ = LifeState::refused;
    return LifeAction::refuse;
  }
  state_ = LifeState::joining;
  return LifeAction::take_live_state;
}

void WorkerStates::state_taken() {
  if (state_ != LifeState::joining) expect(state_, LifeState::renewing, "a live state taken");
  state_ = LifeState::training;
}

LifeVerdict WorkerStates::after_step(double now, const StepFacts& facts) {
  expect(state_, LifeState::training, "a step done");
  LifeVerdict v;
  if (facts.store_silent_for > 0 && !silent_since_) {
    silent_since_ = now - facts.store_silent_for;
    v.store = StoreNews::went_silent;
  } else if (facts.store_silent_for <= 0 && silent_since_) {
    silent_since_.reset();
    v.store = StoreNews::answers_again;
  }
  if (facts.last) {
    state_ = LifeState::finished;
    v.action = LifeAction::finish;
  } else if (facts.diverged && rules_.renews) {
    state_ = LifeState::renewing;
    v.action = LifeAction::renew;
  } else if (facts.leave_asked) {
    state_ = LifeState::left;
    v.action = LifeAction::leave;
  } else if (silent_since_ && rules_.store_outage && now - *silent_since_ > *rules_.store_outage) {
    state_ = LifeState::ended_without_store;
    v.action = LifeAction::end_without_store;
  }
  return v;
}

}  // namespace noloco
