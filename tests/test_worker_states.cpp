// A worker's life as one machine (train/worker_states.h), ticked with
// invented times: every state and transition the multi-process tests reach
// (a restart, a join, a refusal, SIGTERM, a store outage short and long, a
// partner refusing a diverged replica, the last step).
#include <gtest/gtest.h>

#include <stdexcept>

#include "train/worker_states.h"

using namespace noloco;

namespace {

LifeRules noloco_rules(double store_outage = 60) {
  LifeRules r;
  r.takes_back = true;
  r.renews = true;
  r.store_outage = store_outage;
  return r;
}

StepFacts step(bool last = false) {
  StepFacts f;
  f.last = last;
  return f;
}

}  // namespace

TEST(WorkerStates, AFirstStartTrainsToTheLastStepAndFinishes) {
  WorkerStates life(noloco_rules());
  EXPECT_EQ(life.state(), LifeState::starting);
  EXPECT_EQ(life.start(false), LifeAction::train_on);
  EXPECT_EQ(life.state(), LifeState::training);
  for (int64_t done = 1; done < 10; ++done) EXPECT_EQ(life.after_step(double(done), step()).action, LifeAction::train_on);
  EXPECT_EQ(life.after_step(10, step(true)).action, LifeAction::finish);
  EXPECT_EQ(life.state(), LifeState::finished);
  EXPECT_THROW(life.after_step(11, step()), std::logic_error) << "no step after the end";
}

TEST(WorkerStates, ARestartedOrJoiningWorkerTakesALiveStateWhereTheRunTakesItBack) {
  WorkerStates joiner(noloco_rules());
  EXPECT_EQ(joiner.start(true), LifeAction::take_live_state);
  EXPECT_EQ(joiner.state(), LifeState::joining);
  EXPECT_THROW(joiner.after_step(1, step()), std::logic_error) << "it trains only once it holds a state";
  joiner.state_taken();
  EXPECT_EQ(joiner.state(), LifeState::training);

  LifeRules diloco;  // DiLoCo: nobody is taken back
  WorkerStates refused(diloco);
  EXPECT_EQ(refused.start(true), LifeAction::refuse);
  EXPECT_EQ(refused.state(), LifeState::refused);
  EXPECT_EQ(WorkerStates(diloco).start(false), LifeAction::train_on);
}

TEST(WorkerStates, SigtermLeavesBeforeTheLastStepAndNotAtIt) {
  WorkerStates life(noloco_rules());
  life.start(false);
  auto asked = step();
  asked.leave_asked = true;
  EXPECT_EQ(life.after_step(5, asked).action, LifeAction::leave);
  EXPECT_EQ(life.state(), LifeState::left);

  WorkerStates at_end(noloco_rules());
  at_end.start(false);
  auto last = step(true);
  last.leave_asked = true;
  EXPECT_EQ(at_end.after_step(10, last).action, LifeAction::finish) << "the last step's work is done anyway";
}

TEST(WorkerStates, ADivergedReplicaRenewsFromALiveStateAndTrainsOn) {
  WorkerStates life(noloco_rules());
  life.start(false);
  auto refused = step();
  refused.diverged = true;
  refused.leave_asked = true;  // renewing comes first: its partners wait for it at the next outer step
  EXPECT_EQ(life.after_step(20, refused).action, LifeAction::renew);
  EXPECT_EQ(life.state(), LifeState::renewing);
  life.state_taken();
  EXPECT_EQ(life.after_step(21, step()).action, LifeAction::train_on);

  LifeRules workers = noloco_rules();
  workers.renews = false;  // a replica of several workers keeps its state
  WorkerStates kept(workers);
  kept.start(false);
  auto diverged = step();
  diverged.diverged = true;
  EXPECT_EQ(kept.after_step(20, diverged).action, LifeAction::train_on);
  EXPECT_THROW(kept.state_taken(), std::logic_error);
}

// store_outage=60: a store silent since t=100 (first seen at t=101, 1 s in)
// is said once; back at t=130 it is said again, and the worker trained on
// throughout. Silent again from t=200, the worker ends at the first tick past
// t=260, not before.
TEST(WorkerStates, AStoreSilentPastItsBoundEndsTheWorkerAndAShorterOutageIsTrainedThrough) {
  WorkerStates life(noloco_rules(60));
  life.start(false);
  auto silent = [](double for_seconds) {
    auto f = step();
    f.store_silent_for = for_seconds;
    return f;
  };
  EXPECT_EQ(life.after_step(101, silent(1)).store, StoreNews::went_silent);
  EXPECT_EQ(life.store_silent_since(), 100.0);
  const auto mid = life.after_step(120, silent(20));
  EXPECT_EQ(mid.store, StoreNews::none) << "said once";
  EXPECT_EQ(mid.action, LifeAction::train_on);
  const auto back = life.after_step(130, step());
  EXPECT_EQ(back.store, StoreNews::answers_again);
  EXPECT_EQ(back.action, LifeAction::train_on);
  EXPECT_FALSE(life.store_silent_since());

  EXPECT_EQ(life.after_step(205, silent(5)).store, StoreNews::went_silent);
  EXPECT_EQ(life.after_step(260, silent(60)).action, LifeAction::train_on) << "60 s is within the bound";
  EXPECT_EQ(life.after_step(260.5, silent(60.5)).action, LifeAction::end_without_store);
  EXPECT_EQ(life.state(), LifeState::ended_without_store);

  LifeRules door = noloco_rules();
  door.store_outage.reset();  // the Python door: the user's loop owns its end
  WorkerStates alone(door);
  alone.start(false);
  alone.after_step(0, silent(1));
  EXPECT_EQ(alone.after_step(1e6, silent(1e6)).action, LifeAction::train_on);
}
