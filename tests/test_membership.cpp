// Membership (comm/membership/membership.h) on an in-memory store: who is in an outer
// step's snapshot as workers join, take their state and die.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>

#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include "comm/store/abandonable_store.h"
#include "comm/membership/membership.h"
#include "config/worker_env.h"

using namespace noloco;
using namespace std::chrono_literals;

namespace {

std::vector<int> ranks_of(const std::vector<Peer>& peers) {
  std::vector<int> out;
  for (const auto& p : peers) out.push_back(p.rank);
  return out;
}

WorkerEnv env_of(int rank, int world) {
  WorkerEnv env;
  env.rank = rank;
  env.world = world;
  env.token = "membership-test";
  return env;
}

}  // namespace

TEST(Membership, AJoinerIsInSnapshotsOnlyOnceItHoldsALiveReplicasState) {
  const StorePtr store = c10::make_intrusive<c10d::HashStore>();
  const std::string scope = "replicas", token = env_of(0, 2).token;
  Membership first(store, env_of(0, 2), scope, 0, 2, 60s, 60s), second(store, env_of(1, 2), scope, 1, 2, 60s, 60s);
  EXPECT_FALSE(first.joining());

  // Ids count on from the run's first members, one per joiner.
  const int id = claim_member_id(store, token, scope, 2);
  EXPECT_EQ(id, 2);
  EXPECT_EQ(claim_member_id(store, token, scope, 2), 3) << "the next joiner gets the next id";
  Membership joiner(store, env_of(id, 2), scope, id, 2, 60s, 60s);
  EXPECT_TRUE(joiner.joining());
  EXPECT_EQ(joiner.incarnation(), 0);

  // Waiting for its state, it is in nobody's grouping.
  int donor = -1;
  std::thread waiting([&] { donor = joiner.request_state(30s); });
  std::vector<std::pair<int, std::string>> claimed;
  for (int i = 0; i < 200 && claimed.empty(); ++i) {
    claimed = first.claim_requests();
    if (claimed.empty()) std::this_thread::sleep_for(10ms);
  }
  EXPECT_EQ(ranks_of(second.snapshot("outer/1")), (std::vector<int>{0, 1}));
  waiting.join();
  ASSERT_EQ(claimed.size(), 1u);
  EXPECT_EQ(claimed[0].first, id);
  EXPECT_EQ(claimed[0].second, joiner.handover_channel());
  EXPECT_EQ(donor, 0);
  EXPECT_TRUE(second.claim_requests().empty()) << "one donor per request";

  joiner.rejoined();
  EXPECT_FALSE(joiner.joining());
  EXPECT_EQ(joined_members(store, token, scope), (std::vector<int>{id}));
  EXPECT_EQ(ranks_of(second.snapshot("outer/2")), (std::vector<int>{0, 1, 2}));
  EXPECT_EQ(ranks_of(joiner.snapshot("outer/2")), (std::vector<int>{0, 1, 2})) << "everyone reads the same snapshot";
  EXPECT_EQ(member_state(store, token, scope, id), MemberState::running);

  // Declared dead by a partner: out of later snapshots, and the launcher sees it lost.
  first.declare_dead(id);
  EXPECT_EQ(ranks_of(first.snapshot("outer/3")), (std::vector<int>{0, 1}));
  EXPECT_EQ(member_state(store, token, scope, id), MemberState::dead);
  second.finish();
  EXPECT_EQ(member_state(store, token, scope, 1), MemberState::finished);
}

TEST(Membership, AJoinerWithNobodyLeftToServeItIsToldWhy) {
  const StorePtr store = c10::make_intrusive<c10d::HashStore>();
  const std::string scope = "replicas", token = env_of(0, 1).token;
  Membership only(store, env_of(0, 1), scope, 0, 1, 60s, 60s);
  only.finish();
  const int id = claim_member_id(store, token, scope, 1);
  Membership joiner(store, env_of(id, 1), scope, id, 1, 60s, 60s);
  try {
    joiner.request_state(10s);
    FAIL() << "no donor is left";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("the run finished before this worker could rejoin it"), std::string::npos)
        << e.what();
  }
}

// Forming a group with a member that died after coming to the meeting: the
// rendezvous store gives up as soon as the member is known gone (issue 33:
// waits after a death the launcher had already recorded), not at the end of
// its timeout; and otherwise it is the store it wraps.
TEST(AbandonableStore, StopsWaitingOnceAMemberIsGoneAndOtherwiseWaits) {
  using Clock = std::chrono::steady_clock;
  const StorePtr inner = c10::make_intrusive<c10d::HashStore>();
  inner->setTimeout(std::chrono::seconds(20));
  std::atomic<bool> gone{false};
  const auto store = abandonable(inner, [&] { return gone.load(); }, std::chrono::milliseconds(50));
  std::thread death([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    gone = true;
  });
  auto start = Clock::now();
  EXPECT_THROW(store->get("never-set"), std::runtime_error);
  death.join();
  const auto abandoned_after = Clock::now() - start;
  EXPECT_GE(abandoned_after, std::chrono::milliseconds(300));
  EXPECT_LT(abandoned_after, std::chrono::seconds(5));  // far under the 20-s timeout

  gone = false;
  std::thread later([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    inner->set("key", {'v'});
  });
  EXPECT_EQ(store->get("key"), (std::vector<uint8_t>{'v'}));  // waited for it across slices
  later.join();
  start = Clock::now();
  EXPECT_THROW(store->wait({"other"}, std::chrono::milliseconds(400)), std::runtime_error);  // its own bound holds
  EXPECT_GE(Clock::now() - start, std::chrono::milliseconds(400));
  EXPECT_EQ(store->add("n", 2), 2);
  EXPECT_TRUE(store->check({"key", "n"}));
}
