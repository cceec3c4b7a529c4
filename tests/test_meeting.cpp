// The meeting before an exchange (comm/transport/meeting.h): its protocol
// ticked alone, then members meeting over an in-memory store on threads.
#include <gtest/gtest.h>

#include <future>
#include <thread>

#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "comm/store/run_record.h"
#include "comm/transport/meeting.h"

using namespace noloco;
using namespace std::chrono_literals;
using State = MeetingProtocol::State;

namespace {

const auto t0 = MeetingProtocol::Clock::time_point() + 1h;

auto none_come() {
  return [](int) { return false; };
}

std::vector<int> ranks_of(const std::vector<Peer>& peers) {
  std::vector<int> out;
  for (const auto& p : peers) out.push_back(p.rank);
  return out;
}

}  // namespace

TEST(MeetingProtocol, AMemberGivenUpBeforeItCameGoesOnAloneAndGivesNobodyUp) {
  MeetingProtocol p({1, 2}, t0, 100ms, false);
  EXPECT_EQ(p.state(), State::announcing);
  p.arrived(int64_t(Arrival::came) + int64_t(Arrival::given_up));
  EXPECT_EQ(p.state(), State::alone);
  EXPECT_TRUE(p.overdue(t0 + 1h, none_come(), none_come()).empty());
  EXPECT_THROW(p.decide({}, {}), std::logic_error);
  EXPECT_THROW(p.arrived(int64_t(Arrival::came)), std::logic_error);
}

TEST(MeetingProtocol, WithoutPatienceThePeersNotComeByTheTimeoutAreGivenUp) {
  MeetingProtocol p({1, 2, 3}, t0, 100ms, false);
  EXPECT_TRUE(p.overdue(t0 + 1h, none_come(), none_come()).empty()) << "not arrived yet: nothing to watch";
  p.arrived(int64_t(Arrival::came));
  EXPECT_EQ(p.state(), State::waiting);
  const auto only_2_came = [](int r) { return r == 2; };
  EXPECT_TRUE(p.overdue(t0 + 50ms, only_2_came, none_come()).empty());
  EXPECT_EQ(p.overdue(t0 + 150ms, only_2_came, none_come()), (std::vector<int>{1, 3}));
  // Before the timeout, the authority's word is enough.
  EXPECT_EQ(p.overdue(t0 + 50ms, only_2_came, [](int r) { return r == 3; }), (std::vector<int>{3}));
  EXPECT_FALSE(p.tell_waiting(t0 + 10s)) << "nobody to tell without an authority";
}

TEST(MeetingProtocol, WithPatienceOnlyTheAuthorityGivesAPeerUpAndHearsOnceASecondThatThisMemberWaits) {
  MeetingProtocol p({1, 2}, t0, 100ms, true);
  p.arrived(int64_t(Arrival::came));
  EXPECT_TRUE(p.overdue(t0 + 1h, none_come(), none_come()).empty());
  const auto gave_up_2 = [](int r) { return r == 2; };
  EXPECT_EQ(p.overdue(t0 + 1s, none_come(), gave_up_2), (std::vector<int>{2}));
  EXPECT_TRUE(p.overdue(t0 + 1s, [](int) { return true; }, gave_up_2).empty()) << "came already: not given up";
  EXPECT_FALSE(p.tell_waiting(t0 + 500ms));
  EXPECT_TRUE(p.tell_waiting(t0 + 1500ms));
  EXPECT_FALSE(p.tell_waiting(t0 + 2000ms));
  EXPECT_TRUE(p.tell_waiting(t0 + 2600ms));
}

TEST(MeetingProtocol, DecidesWhoCameWhoIsLateAndWhoDeclinedFromTheCounters) {
  MeetingProtocol p({1, 2, 3, 4, 5}, t0, 100ms, false);
  p.arrived(int64_t(Arrival::came));
  const std::vector<Peer> peers{{1, 0}, {2, 0}, {3, 1}, {4, 0}, {5, 0}};
  const int64_t came = int64_t(Arrival::came), given_up = int64_t(Arrival::given_up),
                away = int64_t(Arrival::stays_away);
  const auto out = p.decide(peers, {{1, {came, 7}},
                                    {2, {came + given_up, std::nullopt}},
                                    {3, {came, 0}},
                                    {4, {away + given_up, std::nullopt}},
                                    {5, {came, std::nullopt}}});  // came to meet others
  EXPECT_EQ(p.state(), State::met);
  EXPECT_EQ(ranks_of(out.present), (std::vector<int>{1, 3}));
  EXPECT_EQ(out.present[1].incarnation, 1);
  EXPECT_EQ(out.theirs, (std::map<int, int64_t>{{1, 7}, {3, 0}}));
  EXPECT_EQ(out.late, (std::vector<int>{2}));
  EXPECT_EQ(out.declined, (std::vector<int>{4, 5}));
  EXPECT_THROW(p.decide(peers, {}), std::logic_error) << "decided once";
}

// Issue 105: a partner alive but late is left behind after the partner
// wait, not lost; the authority's word still makes it lost; one that came
// just before the give-up landed is present, by its own word.
TEST(MeetingProtocol, APartnerWaitLeavesALatePeerBehindWithoutLosingIt) {
  MeetingProtocol p({1, 2, 3}, t0, 60s, /*patient=*/true, /*partner_wait=*/200ms);
  p.arrived(int64_t(Arrival::came));
  const auto only_3_came = [](int r) { return r == 3; };
  EXPECT_TRUE(p.overdue(t0 + 150ms, only_3_came, none_come()).empty());
  EXPECT_EQ(p.overdue(t0 + 250ms, only_3_came, none_come()), (std::vector<int>{1, 2}));
  const int64_t came = int64_t(Arrival::came), given_up = int64_t(Arrival::given_up);
  EXPECT_FALSE(p.verdict_needed(came));
  EXPECT_FALSE(p.verdict_needed(given_up));
  EXPECT_TRUE(p.verdict_needed(came + given_up));
  const std::vector<Peer> peers{{1, 0}, {2, 0}, {3, 0}};
  const auto out = p.decide(peers,
                            {{1, {given_up, std::nullopt}}, {2, {given_up, std::nullopt}},
                             {3, {came + given_up, 5, /*came_first=*/true}}},
                            [](int r) { return r == 2; });  // the authority gave 2 up: lost
  EXPECT_EQ(out.behind, (std::vector<int>{1}));
  EXPECT_EQ(out.late, (std::vector<int>{2}));
  EXPECT_EQ(ranks_of(out.present), (std::vector<int>{3}));

  MeetingProtocol without_wait({1}, t0, 60s, true);
  without_wait.arrived(came);
  EXPECT_FALSE(without_wait.verdict_needed(came + given_up));
  EXPECT_TRUE(without_wait.overdue(t0 + 1h, none_come(), none_come()).empty()) << "patient: the authority alone";
  EXPECT_EQ(without_wait.decide({{1, 0}}, {{1, {came + given_up, std::nullopt}}}, none_come()).late,
            (std::vector<int>{1}))
      << "as before the partner wait";
}

namespace {

// Members of one group meeting on threads, each with connections of its own
// to one TCPStore on loopback (HashStore's add wakes no waiter, which the
// meeting relies on, as etcd's and torchrun's stores do).
c10::intrusive_ptr<c10d::Store> tcp_store(uint16_t port) {
  c10d::TCPStoreOptions o;
  o.port = port;
  o.isServer = port == 0;
  o.waitWorkers = false;
  o.numWorkers = c10::nullopt;
  o.timeout = 30s;
  return c10::make_intrusive<c10d::TCPStore>("127.0.0.1", o);
}

struct Room {
  c10::intrusive_ptr<c10d::TCPStore> server = c10::static_intrusive_pointer_cast<c10d::TCPStore>(tcp_store(0));
  Meeting member(int self, std::chrono::milliseconds timeout) {
    return Meeting([port = uint16_t(server->getPort())] { return tcp_store(port); }, "meeting-test", "replicas", self,
                   timeout, nullptr);
  }
  // The meeting's keys as the members see them.
  StorePtr keys() { return run_scope(tcp_store(uint16_t(server->getPort())), "meeting-test", record::meeting("replicas")); }
};

}  // namespace

TEST(Meeting, MembersMeetAndEachSeesTheLinkTheOthersHoldToIt) {
  Room room;
  std::vector<std::future<MeetingOutcome>> outcomes;
  for (int self = 0; self < 3; ++self)
    outcomes.push_back(std::async(std::launch::async, [&room, self] {
      std::vector<Peer> peers;
      std::map<int, int64_t> mine;
      for (int r = 0; r < 3; ++r)
        if (r != self) {
          peers.push_back({r, 0});
          mine[r] = 10 * self + r;  // the id of the link `self` holds to r
        }
      return room.member(self, 20s).meet("7/0,1,2", 7, peers, mine);
    }));
  for (int self = 0; self < 3; ++self) {
    const auto out = outcomes[size_t(self)].get();
    EXPECT_EQ(out.present.size(), 2u) << "member " << self;
    EXPECT_TRUE(out.late.empty() && out.declined.empty()) << "member " << self;
    for (const auto& [r, id] : out.theirs) EXPECT_EQ(id, 10 * r + self) << "member " << self << " from " << r;
  }
}

TEST(Meeting, OneThatStaysAwayIsDeclinedOneThatNeverCameIsLateAndGoesOnAloneWhenItComes) {
  Room room;
  room.member(1, 20s).stay_away("8/0,1,2");
  const auto start = std::chrono::steady_clock::now();
  const auto out = room.member(0, 300ms).meet("8/0,1,2", 8, {{1, 0}, {2, 0}}, {});
  // (Had giving member 2 up not woken the wait, TCPStore's wait would have thrown after 30 s.)
  EXPECT_GE(std::chrono::steady_clock::now() - start, 300ms) << "member 2 was waited for up to the timeout";
  EXPECT_TRUE(out.present.empty());
  EXPECT_EQ(out.declined, (std::vector<int>{1}));
  EXPECT_EQ(out.late, (std::vector<int>{2}));
  // Member 2, arriving late, finds it was given up: it goes on alone at once, blaming nobody.
  const auto late = room.member(2, 20s).meet("8/0,1,2", 8, {{0, 0}, {1, 0}}, {});
  EXPECT_TRUE(late.present.empty() && late.late.empty() && late.declined.empty());
}

// Issue 105: met with a partner wait, a peer not come within it is left
// behind and, when it comes, goes on alone, told so; one that came just
// before the give-up landed (its counter says both) meets all the same, on
// its own word, and so do its partners.
TEST(Meeting, APartnerWaitLeavesALatePeerBehindAndOneThatCameJustBeforeItMeets) {
  Room room;
  const auto start = std::chrono::steady_clock::now();
  const std::vector<uint8_t> note = {7, 0, 9};
  const auto out = room.member(0, 20s).meet("9/0,1", 9, {{1, 0}}, {}, note, 300ms);
  EXPECT_GE(std::chrono::steady_clock::now() - start, 300ms);
  EXPECT_LT(std::chrono::steady_clock::now() - start, 10s) << "waited out the partner wait, not the timeout";
  EXPECT_EQ(out.behind, (std::vector<int>{1}));
  EXPECT_TRUE(out.late.empty() && out.present.empty());
  const auto late = room.member(1, 20s).meet("9/0,1", 9, {{0, 0}}, {}, {}, 300ms);
  EXPECT_TRUE(late.left_behind);
  EXPECT_EQ(late.notes, (std::map<int, std::vector<uint8_t>>{{0, note}})) << "it hears what member 0 noted";
  EXPECT_TRUE(late.present.empty() && late.late.empty() && late.behind.empty());

  // Member 1 comes first; the give-up lands on its counter just after.
  auto first = std::async(std::launch::async,
                          [&room] { return room.member(1, 20s).meet("10/0,1", 10, {{0, 0}}, {{0, 4}}, {}, 10s); });
  const auto keys = room.keys();
  while (!keys->check({record::arrival_verdict("10/0,1", 1)})) std::this_thread::sleep_for(5ms);
  keys->add(record::arrival("10/0,1", 1), int64_t(Arrival::given_up));
  const auto second = room.member(0, 20s).meet("10/0,1", 10, {{1, 0}}, {{1, 3}}, {}, 300ms);
  const auto came_first = first.get();
  EXPECT_EQ(ranks_of(second.present), (std::vector<int>{1}));
  EXPECT_EQ(second.theirs, (std::map<int, int64_t>{{1, 4}}));
  EXPECT_EQ(ranks_of(came_first.present), (std::vector<int>{0}));
  EXPECT_FALSE(came_first.left_behind);
}
