// Forming Gloo groups (comm/transport/gloo_group.h) with a stranger on the network:
// Gloo 2022 takes the first connection to a pair's port as the peer. Issue
// 33 item 4: a process that is not a member held such connections and every
// exchange on the group waited out peer_timeout and was lost.
#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <random>
#include <regex>
#include <set>
#include <sstream>
#include <thread>

#include <fmt/format.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/torch.h>

#include "comm/transport/gloo_group.h"
#include "comm/transport/seal.h"

using namespace noloco;

namespace {

using Clock = std::chrono::steady_clock;

enum class Stranger { silent, garbage };

sockaddr_in address_at(const std::vector<uint8_t>& addresses, int entries, int index) {
  sockaddr_in a{};
  std::memcpy(&a, addresses.data() + size_t(index) * (addresses.size() / size_t(entries)), sizeof(a));
  return a;
}

// The run's store as a stranger who reads Gloo's rendezvous sees it (the
// worst case: in a run the keys are secret and the stranger must scan for
// the ports). On the attacked tries, once every member has published the
// addresses of its pairs, the stranger connects to the listening port of
// one pair, the one Gloo's address order makes the hardest to recover from:
// its connecting member would also have connected, later, to a third member
// that listens for it. Members publish before they read, so holding their
// publications back until all are in cannot deadlock.
class StrangerOnTheNetwork final : public c10d::Store {
 public:
  StrangerOnTheNetwork(int world, int attacked_tries, Stranger kind)
      : world_(world), attacked_tries_(attacked_tries), kind_(kind), inner_(c10::make_intrusive<c10d::HashStore>()) {
    inner_->setTimeout(std::chrono::seconds(60));
  }
  ~StrangerOnTheNetwork() override {
    for (int fd : held_) ::close(fd);
  }

  void set(const std::string& key, const std::vector<uint8_t>& value) override {
    static const std::regex address_key(R"(/pg/(\d+)/0/(\d+)$)");
    std::smatch m;
    if (std::regex_search(key, m, address_key)) tries_ = std::max(tries_.load(), std::stoi(m[1]) + 1);
    if (std::regex_search(key, m, address_key) && std::stoi(m[1]) < attacked_tries_) {
      const int attempt = std::stoi(m[1]);
      std::unique_lock<std::mutex> lock(mutex_);
      auto& published = published_[attempt];
      published[std::stoi(m[2])] = value;
      if (int(published.size()) == world_) attack(published);
      wake_.notify_all();
      wake_.wait_for(lock, std::chrono::seconds(60), [&] { return int(published.size()) == world_; });
    }
    inner_->set(key, value);
  }
  std::vector<uint8_t> get(const std::string& key) override { return inner_->get(key); }
  std::vector<uint8_t> compareSet(const std::string& key, const std::vector<uint8_t>& expected,
                                  const std::vector<uint8_t>& desired) override {
    return inner_->compareSet(key, expected, desired);
  }
  int64_t add(const std::string& key, int64_t value) override { return inner_->add(key, value); }
  bool deleteKey(const std::string& key) override { return inner_->deleteKey(key); }
  bool check(const std::vector<std::string>& keys) override { return inner_->check(keys); }
  int64_t getNumKeys() override { return inner_->getNumKeys(); }
  // One stranger, however many connections c10d asks for (LibTorch 2.x's clone()).
  c10::intrusive_ptr<c10d::Store> clone() {
    return c10::intrusive_ptr<c10d::Store>::unsafe_reclaim_from_nonowning(this);
  }
  void wait(const std::vector<std::string>& keys) override { inner_->wait(keys); }
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override {
    inner_->wait(keys, timeout);
  }

  // Connections the stranger made that a member's port accepted.
  const std::vector<int>& held() const { return held_; }
  // The attacked pair's client had a later pair whose member listens for it.
  bool stranding() const { return stranding_; }
  // How many tries the formation took.
  int tries() const { return tries_; }

 private:
  void attack(const std::map<int, std::vector<uint8_t>>& published) {
    // Gloo: of a pair, the member whose port for it is the lower (raw) listens.
    auto port_of = [&](int member, int peer) {
      return address_at(published.at(member), world_ - 1, peer > member ? peer - 1 : peer).sin_port;
    };
    auto listens = [&](int a, int b) { return port_of(a, b) < port_of(b, a); };
    int listener = -1, client = -1;
    for (int c = 0; c < world_; ++c)
      for (int l = 0; l < world_; ++l) {
        if (l == c || !listens(l, c)) continue;
        // The client connects its pairs in member order: failing at l, it
        // never connects to a later x that listens for it.
        bool strands = false;
        for (int x = l + 1; x < world_; ++x) strands = strands || (x != c && listens(x, c));
        if (listener < 0 || (strands && !stranding_)) {
          listener = l;
          client = c;
          stranding_ = strands;
        }
      }
    const auto target = address_at(published.at(listener), world_ - 1, client > listener ? client - 1 : client);
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    if (::connect(fd, reinterpret_cast<const sockaddr*>(&target), sizeof(target)) != 0) {
      ::close(fd);
      return;
    }
    if (kind_ == Stranger::garbage) {
      std::mt19937_64 random(7);
      std::vector<uint64_t> junk(100 * 1024 / 8);
      for (auto& w : junk) w = random() | (uint64_t(1) << 40);  // never one of Gloo's four opcodes
      (void)::send(fd, junk.data(), junk.size() * 8, MSG_NOSIGNAL);
    }
    held_.push_back(fd);
  }

  const int world_, attacked_tries_;
  const Stranger kind_;
  c10::intrusive_ptr<c10d::Store> inner_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::map<int, std::map<int, std::vector<uint8_t>>> published_;
  std::vector<int> held_;
  bool stranding_ = false;
  std::atomic<int> tries_{0};
};

struct Joined {
  GlooGroup group;
  std::string error;
  double seconds = 0;
};

// Members of a run with `token`: the greeting keeps strangers out.
std::vector<Joined> join_all(const c10::intrusive_ptr<c10d::Store>& store, int world, const Seal* seal,
                             const std::string& token) {
  // As in every worker (src/cli/main.cpp): a write to a connection the other
  // end closed (a stranger's, a given-up member's) is an error, not death.
  ::signal(SIGPIPE, SIG_IGN);
  std::vector<Joined> joined{size_t(world)};
  std::vector<std::thread> members;
  for (int r = 0; r < world; ++r)
    members.emplace_back([&, r] {
      WorkerEnv env;
      env.rank = r;
      env.world = world;
      env.token = token;
      const auto start = Clock::now();
      try {
        joined[size_t(r)].group = join_gloo_group(store, env, "group", r, world, "127.0.0.1",
                                                  std::chrono::seconds(30), seal);
      } catch (const std::exception& e) {
        joined[size_t(r)].error = e.what();
      }
      joined[size_t(r)].seconds = std::chrono::duration<double>(Clock::now() - start).count();
    });
  for (auto& m : members) m.join();
  return joined;
}

// The far end closed the connection (EOF or reset), looking for at most 5 s.
bool closed_by_the_member(int fd) {
  timeval bound{5, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &bound, sizeof(bound));
  char buffer[4096];
  for (;;) {
    const auto n = ::recv(fd, buffer, sizeof(buffer), 0);
    if (n == 0) return true;
    if (n < 0) return errno != EAGAIN && errno != EWOULDBLOCK;
  }
}

// Every member formed the group, and an all-reduce over it gives the right sum.
void expect_a_working_group(const std::vector<Joined>& joined) {
  const int world = int(joined.size());
  for (const auto& j : joined) ASSERT_TRUE(j.group) << j.error;
  std::vector<std::thread> members;
  std::vector<float> sums(joined.size());
  for (int r = 0; r < world; ++r)
    members.emplace_back([&, r] {
      std::vector<at::Tensor> t{torch::full({4}, float(r + 1))};
      joined[size_t(r)].group->allreduce(t)->wait(std::chrono::seconds(10));
      sums[size_t(r)] = t[0][3].item<float>();
    });
  for (auto& m : members) m.join();
  for (float s : sums) EXPECT_EQ(s, float(world * (world + 1) / 2));
}

}  // namespace

// A stranger takes a pair's connection on the first try: the members notice
// within a bounded time (far under the 30-s timeout), drop the stranger's
// connection and form the group again on fresh ports; the group then works.
// With three members, tries are repeated until the attacked pair's member
// would have stranded a third one waiting for its connection (Gloo's pair
// ports make that so in 3 of 4 draws).
TEST(GlooGroup, AStrangerOnAPairsPortIsDroppedAndTheGroupFormsAgain) {
  GTEST_SKIP() << "the stranger here attacks Gloo 2022's pairs (a listening port per pair, the first connection "
                  "wins); LibTorch 2.x's Gloo has one listener per device naming connections by sequence number, "
                  "which this attack does not model (issue 80's notes)";
  const Seal seal("gloo-group-test");
  struct Case {
    int world;
    Stranger kind;
    const Seal* seal;
  };
  bool stranded = false;
  const Case three{3, Stranger::silent, &seal};
  for (const auto c : {Case{2, Stranger::silent, nullptr}, Case{2, Stranger::garbage, &seal}, three, three, three,
                       three, three, three}) {
    if (c.world == 3 && stranded) break;
    SCOPED_TRACE(::testing::Message() << "world " << c.world
                                      << (c.kind == Stranger::garbage ? ", garbage" : ", silent"));
    const auto store = c10::make_intrusive<StrangerOnTheNetwork>(c.world, /*attacked_tries=*/1, c.kind);
    const auto joined = join_all(store, c.world, c.seal, "");
    ASSERT_EQ(store->held().size(), 1u) << "the stranger never got a member's port";
    EXPECT_EQ(store->tries(), 2);
    stranded = store->stranding();
    for (const auto& j : joined) EXPECT_LT(j.seconds, 10.0);
    EXPECT_TRUE(closed_by_the_member(store->held()[0])) << "the stranger's connection is still held";
    expect_a_working_group(joined);
  }
  EXPECT_TRUE(stranded) << "no draw of three members' ports stranded one (1 in 4^6 by chance)";
}

// A stranger that wins every try: the members give up
// within a bounded time, all of them, with one line that says what may be
// going on.
TEST(GlooGroup, AStrangerOnEveryTryEndsTheFormationInBoundedTime) {
  GTEST_SKIP() << "the stranger here attacks Gloo 2022's pairs (a listening port per pair, the first connection "
                  "wins); LibTorch 2.x's Gloo has one listener per device naming connections by sequence number, "
                  "which this attack does not model (issue 80's notes)";
  const auto store = c10::make_intrusive<StrangerOnTheNetwork>(2, kGroupAttempts, Stranger::silent);
  const auto joined = join_all(store, 2, nullptr, "");
  EXPECT_EQ(store->held().size(), size_t(kGroupAttempts));
  for (const auto& j : joined) {
    EXPECT_FALSE(j.group);
    EXPECT_LT(j.seconds, 15.0);
    EXPECT_NE(j.error.find(fmt::format("({} tries)", kGroupAttempts)), std::string::npos) << j.error;
    EXPECT_NE(j.error.find("a process that is not a member"), std::string::npos) << j.error;
    EXPECT_EQ(j.error.find('\n'), std::string::npos) << j.error;
  }
}

