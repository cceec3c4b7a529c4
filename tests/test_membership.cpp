// Membership (comm/membership/membership.h) on an in-memory store: who is in an outer
// step's snapshot as workers join, take their state and die; and the
// transport's waits, which end when the liveness authority gives a peer up.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>

#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "comm/store/abandonable_store.h"
#include "comm/membership/membership.h"
#include "comm/store/run_keys.h"
#include "comm/store/store_outage.h"
#include "comm/transport/link_transport.h"
#include "config/worker_env.h"
#include "test_util.h"

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

// Gives up member `gone` once `after` has passed; counts what it is told.
class FakeLiveness final : public Liveness {
 public:
  FakeLiveness(int gone, std::chrono::milliseconds after)
      : gone_(gone), after_(after), at_(std::chrono::steady_clock::now() + after) {}
  // The verdict comes `after` from now (a test's transport may take a moment to start).
  void restart_clock() { at_ = std::chrono::steady_clock::now() + after_; }
  bool given_up(int rank, std::chrono::steady_clock::time_point) override {
    return rank == gone_ && std::chrono::steady_clock::now() >= at_;
  }
  bool silent(int rank) override { return given_up(rank, {}); }
  void declare_dead(int rank) override { declared.push_back(rank); }
  void progressed() override { ++progress; }
  std::vector<int> declared;
  std::atomic<int> progress{0};

 private:
  int gone_;
  std::chrono::milliseconds after_;
  std::chrono::steady_clock::time_point at_;
};

// A TCPStore on this machine, as torchrun's agent hosts one (HashStore's
// add does not wake a waiter, which the transport's meetings rely on).
StorePtr tcp_store(int port, bool server) {
  c10d::TCPStoreOptions o;
  o.port = uint16_t(port);
  o.isServer = server;
  o.waitWorkers = false;
  o.numWorkers = c10::nullopt;
  o.timeout = 30s;
  return c10::make_intrusive<c10d::TCPStore>("127.0.0.1", o);
}

// Where a test member's links start: loopback, sealed, with the test run's keys.
std::shared_ptr<LinkEndpoint> loopback_endpoint() {
  const auto token = env_of(0, 2).token;
  return std::make_shared<LinkEndpoint>(LinkEndpointOptions{}, run_key(token, "link"), run_key(token, "relay"));
}

// Member 0 of 2 in a transport whose waits allow 30 s; member 1 never comes.
struct LoneTransport {
  explicit LoneTransport(Liveness* liveness)
      : port(noloco::testing::free_port()),
        host(tcp_store(port, true)),
        transport([this] { return tcp_store(port, false); }, env_of(0, 2), "replicas", Peer{0, 0}, 2,
                  loopback_endpoint(), 30s, liveness) {}
  int port;
  StorePtr host;
  LinkTransport transport;
};

double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
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
    claimed = first.claim_requests(10);
    if (claimed.empty()) std::this_thread::sleep_for(10ms);
  }
  EXPECT_EQ(ranks_of(second.snapshot("outer/1")), (std::vector<int>{0, 1}));
  waiting.join();
  ASSERT_EQ(claimed.size(), 1u);
  EXPECT_EQ(claimed[0].first, id);
  EXPECT_EQ(claimed[0].second, joiner.handover_channel());
  EXPECT_EQ(donor, 0);
  EXPECT_TRUE(second.claim_requests(10).empty()) << "one donor per request";

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
  const std::string summary = R"({"final_val_loss": 2.5})";
  second.finish(summary);
  EXPECT_EQ(member_state(store, token, scope, 1), MemberState::finished);
  EXPECT_EQ(member_summary(store, token, scope, 1), summary) << "kept for the run's summary.json";
  EXPECT_EQ(member_summary(store, token, scope, 0), "") << "none before it finished";
}

// A replica refused as diverged at inner step 60 takes the state of one at
// 60 or later: a donor one outer step behind (50) would have it take part in
// outer step 60 twice (once the flaky cause of a hang in the drill's test).
TEST(Membership, ARenewedReplicaTakesTheStateOfOneAtItsStepOrLater) {
  const StorePtr store = c10::make_intrusive<c10d::HashStore>();
  const std::string scope = "replicas";
  Membership behind(store, env_of(0, 3), scope, 0, 3, 60s, 60s), level(store, env_of(1, 3), scope, 1, 3, 60s, 60s),
      diverged(store, env_of(2, 3), scope, 2, 3, 60s, 60s);
  diverged.renew(6, 60);
  int donor = -1;
  std::thread waiting([&] { donor = diverged.request_state(30s); });
  std::vector<std::pair<int, std::string>> claimed_behind, claimed_level;
  for (int i = 0; i < 200 && claimed_level.empty(); ++i) {
    for (auto& c : behind.claim_requests(50)) claimed_behind.push_back(c);
    claimed_level = level.claim_requests(60);
    if (claimed_level.empty()) std::this_thread::sleep_for(10ms);
  }
  waiting.join();
  EXPECT_TRUE(claimed_behind.empty()) << "a replica behind the renewer's step does not serve it";
  ASSERT_EQ(claimed_level.size(), 1u);
  EXPECT_EQ(claimed_level[0].first, 2);
  EXPECT_EQ(claimed_level[0].second, diverged.handover_channel());
  EXPECT_EQ(donor, 1);
  EXPECT_TRUE(behind.claim_requests(70).empty()) << "served once, by the replica at its step";
}

// Issue 83 item 6: a replica told to leave (SIGTERM) finishes the exchange
// it has in flight before it is gone. A partner that reaches the next outer
// step meanwhile groups without it, yet still waits for the exchange in
// flight; once it has left, nobody waits for it.
TEST(Membership, AReplicaBeginningToLeaveIsInNoLaterSnapshotAndWaitedForUntilItHasLeft) {
  const StorePtr store = c10::make_intrusive<c10d::HashStore>();
  const std::string scope = "replicas";
  Membership first(store, env_of(0, 3), scope, 0, 3, 60s, 60s), second(store, env_of(1, 3), scope, 1, 3, 60s, 60s),
      leaver(store, env_of(2, 3), scope, 2, 3, 60s, 60s);
  EXPECT_EQ(ranks_of(first.snapshot("5")), (std::vector<int>{0, 1, 2}));
  leaver.begin_leaving();
  EXPECT_EQ(ranks_of(second.snapshot("5")), (std::vector<int>{0, 1, 2})) << "a snapshot taken stays as agreed";
  EXPECT_EQ(ranks_of(second.snapshot("10")), (std::vector<int>{0, 1}));
  EXPECT_EQ(ranks_of(first.snapshot("10")), (std::vector<int>{0, 1}));
  EXPECT_EQ(ranks_of(first.snapshot("evaluation/10")), (std::vector<int>{0, 1}));
  const auto now = std::chrono::steady_clock::now();
  EXPECT_FALSE(first.given_up(2, now)) << "its exchange in flight is still waited for";
  leaver.leave();
  EXPECT_TRUE(second.given_up(2, std::chrono::steady_clock::now()));
  EXPECT_EQ(ranks_of(second.snapshot("15")), (std::vector<int>{0, 1}));
}

TEST(Membership, AJoinerWithNobodyLeftToServeItIsToldWhy) {
  const StorePtr store = c10::make_intrusive<c10d::HashStore>();
  const std::string scope = "replicas", token = env_of(0, 1).token;
  Membership only(store, env_of(0, 1), scope, 0, 1, 60s, 60s);
  only.finish("");
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
    inner->set("key", std::vector<uint8_t>{'v'});
  });
  EXPECT_EQ(store->get("key"), (std::vector<uint8_t>{'v'}));  // waited for it across slices
  later.join();
  start = Clock::now();
  EXPECT_THROW(store->wait({"other"}, std::chrono::milliseconds(400)), std::runtime_error);  // its own bound holds
  EXPECT_GE(Clock::now() - start, std::chrono::milliseconds(400));
  EXPECT_EQ(store->add("n", 2), 2);
  EXPECT_TRUE(store->check({"key", "n"}));
}

// Issue 50 item 1: a donor whose joiner died during the hand-over waited out
// the whole timeout on the training thread, without publishing progress, so
// its partners gave it up too. The wait ends when the authority gives the
// joiner up, and meanwhile tells it the donor is waiting, not stuck.
TEST(Liveness, AHandOverEndsWhenItsReceiverIsGivenUpAndPublishesProgressMeanwhile) {
  FakeLiveness liveness(1, 1500ms);
  LoneTransport lone(&liveness);
  MessageHeader header;
  header.kind = int64_t(MessageKind::state);
  header.bytes = 8;
  liveness.restart_clock();
  const auto start = std::chrono::steady_clock::now();
  EXPECT_THROW(lone.transport.send_state("1.0", 1, header, torch::zeros({8}, torch::kUInt8)), std::runtime_error);
  EXPECT_GE(seconds_since(start), 1.4);
  EXPECT_LT(seconds_since(start), 10.0) << "waited toward the 30-s timeout";
  EXPECT_GT(liveness.progress.load(), 0);
}

// The joiner's side: a donor given up ends its wait the same way.
TEST(Liveness, AStateReceiveEndsWhenItsDonorIsGivenUp) {
  FakeLiveness liveness(1, 500ms);
  LoneTransport lone(&liveness);
  MessageHeader expected;
  expected.kind = int64_t(MessageKind::state);
  const auto start = std::chrono::steady_clock::now();
  EXPECT_THROW(lone.transport.receive_state("0.1", 1, expected, 1 << 20), std::runtime_error);
  EXPECT_LT(seconds_since(start), 10.0);
}

// Issue 50 item 3: an evaluation across replicas waited out the timeout
// for a member that froze just before it.
TEST(Liveness, AnEvaluationGroupIsNotWaitedForOnceAMemberIsGivenUp) {
  FakeLiveness liveness(1, 500ms);
  LoneTransport lone(&liveness);
  const auto start = std::chrono::steady_clock::now();
  std::string why;
  try {
    lone.transport.subgroup("evaluation/100", {{0, 0}, {1, 0}});
  } catch (const std::runtime_error& e) {
    why = e.what();
  }
  EXPECT_LT(seconds_since(start), 10.0);
  // Issue 86: it says who did not come and that its heartbeat is silent, not a guess about routers.
  EXPECT_NE(why.find("the links to 1 of 1 members did not open; alive by their heartbeats: none; silent: 1;"),
            std::string::npos)
      << why;
  EXPECT_EQ(why.find("NAT"), std::string::npos) << why;
}

// An exchange with a member that never comes: given up by the authority,
// reported lost and declared dead to it (later snapshots leave it out).
TEST(Liveness, AnExchangeTellsTheAuthorityWhomItGaveUp) {
  FakeLiveness liveness(1, 500ms);
  LoneTransport lone(&liveness);
  ExchangeRequest request;
  request.id = 7;
  request.group = {{0, 0}, {1, 0}};
  request.payload = torch::zeros({4}, torch::kUInt8);
  request.header.kind = int64_t(MessageKind::exchange);
  request.header.bytes = 4;
  const auto start = std::chrono::steady_clock::now();
  const auto result = lone.transport.exchange(request);
  EXPECT_LT(seconds_since(start), 10.0);
  EXPECT_EQ(result.lost, std::vector<int>{1});
  EXPECT_EQ(liveness.declared, std::vector<int>{1});
  EXPECT_TRUE(result.received.empty());
}

// Issue 67 item 1: a peer's announced length is input. Two members whose
// payloads differ in size (another model) refuse each other's message; before,
// the one expecting less aborted inside Gloo (`op.preamble.length <= op.nbytes`).
TEST(Liveness, AMessageOfAnotherSizeIsRefusedByBothAndAbortsNeither) {
  FakeLiveness liveness[2] = {{-1, 0ms}, {-1, 0ms}};
  const int port = noloco::testing::free_port();
  const auto host = tcp_store(port, true);
  auto transport_of = [&](int rank) {
    return std::make_unique<LinkTransport>([port] { return tcp_store(port, false); }, env_of(rank, 2), "replicas",
                                           Peer{rank, 0}, 2, loopback_endpoint(), 30s, &liveness[rank]);
  };
  auto request_of = [](int64_t bytes) {
    ExchangeRequest request;
    request.id = 3;
    request.group = {{0, 0}, {1, 0}};
    request.payload = torch::full({bytes}, 7, torch::kUInt8);
    request.header.kind = int64_t(MessageKind::exchange);
    request.header.bytes = bytes;
    return request;
  };
  auto small = transport_of(0), large = transport_of(1);
  ExchangeResult from_small, from_large;
  const auto start = std::chrono::steady_clock::now();
  std::thread other([&] { from_large = large->exchange(request_of(1 << 20)); });
  from_small = small->exchange(request_of(1 << 10));
  other.join();
  EXPECT_EQ(from_small.lost, std::vector<int>{1});
  EXPECT_EQ(from_large.lost, std::vector<int>{0});
  EXPECT_TRUE(from_small.received.empty() && from_large.received.empty());
  EXPECT_LT(seconds_since(start), 20.0) << "a refused peer's payload is not waited for until the 30-s timeout";
}

TEST(ExchangeRanges, MergesConsecutiveExchangesKeepsTheLatestFewAndReadsBackWhatItWrote) {
  ExchangeRanges alone;
  for (int64_t id : {5, 6, 7, 9, 9, 4}) alone.add(id);  // 9 twice and 4 after 9: nothing new
  EXPECT_EQ(alone.text(12), "12 5-7 9-9");
  EXPECT_TRUE(alone.covers(6));
  EXPECT_FALSE(alone.covers(8));
  EXPECT_TRUE(alone.any_from(8));
  EXPECT_FALSE(alone.any_from(10));
  EXPECT_EQ(ExchangeRanges::parse(alone.text(12)).ranges(), alone.ranges());
  for (int64_t id = 20; id < 40; id += 2) alone.add(id);
  EXPECT_EQ(alone.ranges().size(), ExchangeRanges::kKept);
  EXPECT_FALSE(alone.covers(5)) << "the oldest ranges go first";
  EXPECT_TRUE(alone.covers(38));
  // What a partner published is input: anything malformed reads as no ranges.
  for (const std::string bad : {"", "x", "12 7-5", "12 5-7 6-8", "12 5+7"})
    EXPECT_TRUE(ExchangeRanges::parse(bad).ranges().empty()) << bad;
  EXPECT_TRUE(ExchangeRanges::parse("12").ranges().empty()) << "an earlier version's value: the exchange alone";
}

// Issue 100 item 1: a partner at a later exchange is not one that went alone
// at this one. Only the exchanges it went alone at (for want of the store)
// are published as such.
TEST(Membership, APartnerAheadIsNotOneThatWentAloneOnlyThePublishedLoneExchangesAre) {
  const StorePtr store = c10::make_intrusive<c10d::HashStore>();
  const std::string scope = "replicas";
  Membership waiting(store, env_of(0, 2), scope, 0, 2, 60s, 60s), ahead(store, env_of(1, 2), scope, 1, 2, 60s, 60s);
  waiting.reach_exchange(7);
  ahead.reach_exchange(7);
  ahead.reach_exchange(8);
  EXPECT_FALSE(waiting.went_alone(1, 7, false)) << "it traded 7 and went on";
  EXPECT_FALSE(waiting.went_alone(1, 7, true));

  Membership other(store, env_of(0, 2), scope, 0, 2, 60s, 60s);  // reads afresh (each reads 4 times a second)
  ahead.go_alone(8);
  ahead.go_alone(9);
  EXPECT_FALSE(other.went_alone(1, 8, false)) << "published with its next exchange, not before";
  ahead.reach_exchange(10);
  Membership later(store, env_of(0, 2), scope, 0, 2, 60s, 60s);
  EXPECT_TRUE(later.went_alone(1, 8, false));
  EXPECT_TRUE(later.went_alone(1, 9, false));
  EXPECT_FALSE(later.went_alone(1, 7, false));
  EXPECT_FALSE(later.went_alone(1, 10, false));
  EXPECT_TRUE(later.went_alone(1, 7, true)) << "between exchanges: alone at 7 or later";
  EXPECT_FALSE(later.went_alone(1, 10, true));
  EXPECT_EQ(later.exchange_reached(), -1);
  later.reach_exchange(9);
  EXPECT_EQ(later.exchange_reached(), 9);
}

namespace {

// Gives up nobody; whether a partner went alone is read from what its
// Membership published in the store, as a worker's Membership reads it.
class PublishedAloneness final : public Liveness {
 public:
  explicit PublishedAloneness(Membership& reader) : reader_(reader) {}
  bool given_up(int, std::chrono::steady_clock::time_point) override { return false; }
  bool silent(int) override { return false; }
  bool went_alone(int rank, int64_t id, bool or_later) override { return reader_.went_alone(rank, id, or_later); }
  void declare_dead(int rank) override { declared.push_back(rank); }
  void progressed() override {}
  std::vector<int> declared;

 private:
  Membership& reader_;
};

ExchangeRequest exchange_request(int64_t id, uint8_t fill) {
  ExchangeRequest request;
  request.id = id;
  request.group = {{0, 0}, {1, 0}};
  request.payload = torch::full({1 << 16}, fill, torch::kUInt8);
  request.header.kind = int64_t(MessageKind::exchange);
  request.header.exchange = id;
  request.header.bytes = request.payload.numel();
  return request;
}

// Two members of one run on a TCPStore, each with the Membership that
// publishes its exchanges and the transport that trades, both at `exchange`.
struct TradingPair {
  explicit TradingPair(int64_t exchange)
      : port(noloco::testing::free_port()),
        host(tcp_store(port, true)),
        members{{tcp_store(port, false), env_of(0, 2), "replicas", 0, 2, 60s, 60s},
                {tcp_store(port, false), env_of(1, 2), "replicas", 1, 2, 60s, 60s}},
        liveness{PublishedAloneness(members[0]), PublishedAloneness(members[1])} {
    for (int r = 0; r < 2; ++r)
      transports[r] = std::make_unique<LinkTransport>([p = port] { return tcp_store(p, false); }, env_of(r, 2),
                                                      "replicas", Peer{r, 0}, 2, loopback_endpoint(), 30s,
                                                      &liveness[r]);
    for (auto& m : members) m.reach_exchange(exchange);
  }
  int port;
  StorePtr host;
  Membership members[2];
  PublishedAloneness liveness[2];
  std::unique_ptr<LinkTransport> transports[2];
};

}  // namespace

// Issue 100 item 1: under overlap a partner moves on to its next exchange as
// soon as its message of this one is written; the worker that has not read it
// yet (its threads held up by a loaded machine) took the later exchange for
// "went alone here", shut the link and went on without the message, while
// the partner had used this worker's: the replicas' results then depended on
// thread timing. Here the partner's message is held back a second after it
// published its next exchange; both still trade.
TEST(Liveness, APartnerAlreadyAtItsNextExchangeIsWaitedForItsMessageOfThisOne) {
  TradingPair pair(7);
  pair.transports[1]->before_next_trade([&] {
    pair.members[1].reach_exchange(8);
    std::this_thread::sleep_for(1s);  // the injected slow machine, not a wait for an event
  });
  ExchangeResult results[2];
  std::thread partner([&] { results[1] = pair.transports[1]->exchange(exchange_request(7, 1)); });
  results[0] = pair.transports[0]->exchange(exchange_request(7, 0));
  partner.join();
  for (int r = 0; r < 2; ++r) {
    EXPECT_TRUE(results[r].lost.empty()) << r;
    ASSERT_EQ(results[r].received.count(1 - r), 1u) << "worker " << r << " went on without its partner's message";
    EXPECT_TRUE(results[r].received.at(1 - r).eq(1 - r).all().item<bool>());
  }
}

// The case the check is for: a partner that came to the meeting and then lost
// the store goes alone there and sends nothing; once it publishes that, it is
// neither waited for nor reported lost.
TEST(Liveness, APartnerThatWentAloneAtThisExchangeIsNotWaitedForNorLost) {
  TradingPair pair(7);
  pair.transports[1]->before_next_trade([&] {
    pair.members[1].go_alone(7);
    pair.members[1].reach_exchange(8);
    throw StoreUnreachable("the store went away after the meeting");
  });
  std::thread partner([&] { EXPECT_THROW(pair.transports[1]->exchange(exchange_request(7, 1)), StoreUnreachable); });
  const auto start = std::chrono::steady_clock::now();
  const auto result = pair.transports[0]->exchange(exchange_request(7, 0));
  partner.join();
  EXPECT_TRUE(result.received.empty());
  EXPECT_TRUE(result.lost.empty());
  EXPECT_TRUE(pair.liveness[0].declared.empty());
  EXPECT_LT(seconds_since(start), 15.0) << "not the 30-s timeout";
}
