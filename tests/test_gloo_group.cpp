// Forming Gloo groups (comm/transport/gloo_group.h) with a stranger on the
// network: LibTorch 2.x's Gloo gives a pair the first connection to its
// device's port that sends the pair's sequence number, and the numbers are
// small. A process that is not a member can take a pair that way; without the
// greeting every exchange on the group would wait out peer_timeout.
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

// The run's store as a stranger who reads Gloo's rendezvous sees it (the
// worst case: in a run the keys are secret and the stranger must find the
// port and guess the numbers, which count from 0). On the attacked tries,
// once every member has published its record, the stranger connects to every
// member's port once for each peer, sending the number that peer's
// connection would send: it takes every pair whose member waits for a
// connection. Members publish before they read, so holding their
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
    static const std::regex record_key(R"(/pg/(\d+)/0/(\d+)$)");
    std::smatch m;
    if (std::regex_search(key, m, record_key)) {
      const int attempt = std::stoi(m[1]);
      tries_ = std::max(tries_.load(), attempt + 1);
      if (attempt < attacked_tries_) {
        std::unique_lock<std::mutex> lock(mutex_);
        auto& published = published_[attempt];
        published[std::stoi(m[2])] = value;
        if (int(published.size()) == world_) attack(published);
        wake_.notify_all();
        wake_.wait_for(lock, std::chrono::seconds(60), [&] { return int(published.size()) == world_; });
      }
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
  c10::intrusive_ptr<c10d::Store> clone() override {
    return c10::intrusive_ptr<c10d::Store>::unsafe_reclaim_from_nonowning(this);
  }
  void wait(const std::vector<std::string>& keys) override { inner_->wait(keys); }
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override {
    inner_->wait(keys, timeout);
  }

  // Connections the stranger made that a member's port accepted.
  const std::vector<int>& held() const { return held_; }
  // How many tries the formation took.
  int tries() const { return tries_; }
  // Records the stranger could not read (Gloo's format changed).
  int unread() const { return unread_; }

 private:
  void attack(const std::map<int, std::vector<uint8_t>>& published) {
    for (const auto& [member, record] : published) {
      const auto entry = parse_gloo_rendezvous_entry(record, world_);
      if (!entry) {
        ++unread_;
        continue;
      }
      for (int peer = 0; peer < world_; ++peer) {
        if (peer == member) continue;
        const auto& target = entry->listener;
        const int fd = ::socket(target.ss_family, SOCK_STREAM, 0);
        if (::connect(fd, reinterpret_cast<const sockaddr*>(&target), sizeof(sockaddr_in)) != 0) {
          ::close(fd);
          continue;
        }
        const uint64_t sequence = uint64_t(entry->sequence_from(peer));
        (void)::send(fd, &sequence, sizeof(sequence), MSG_NOSIGNAL);
        if (kind_ == Stranger::garbage) {
          std::mt19937_64 random(7);
          std::vector<uint64_t> junk(100 * 1024 / 8);
          for (auto& w : junk) w = random() | (uint64_t(1) << 40);  // never one of Gloo's four opcodes
          (void)::send(fd, junk.data(), junk.size() * 8, MSG_NOSIGNAL);
        }
        held_.push_back(fd);
      }
    }
  }

  const int world_, attacked_tries_;
  const Stranger kind_;
  c10::intrusive_ptr<c10d::Store> inner_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::map<int, std::map<int, std::vector<uint8_t>>> published_;
  std::vector<int> held_;
  int unread_ = 0;
  std::atomic<int> tries_{0};
};

struct Joined {
  GlooGroup group;
  std::string error;
  double seconds = 0;
};

// Members of a run with `token`: the greeting keeps strangers out.
std::vector<Joined> join_all(const c10::intrusive_ptr<c10d::Store>& store, int world, const Seal* seal,
                             const std::string& token, std::chrono::seconds timeout = std::chrono::seconds(30)) {
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
                                                  timeout, seal);
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

// A stranger takes every pair it can on the first try: the members notice
// once the greetings are overdue (far under the 30-s timeout), drop the
// stranger's connections with the device and form the group again on a
// fresh one; the group then works.
TEST(GlooGroup, AStrangerOnAPairsPortIsDroppedAndTheGroupFormsAgain) {
  const Seal seal("gloo-group-test");
  struct Case {
    int world;
    Stranger kind;
    const Seal* seal;
  };
  for (const auto c : {Case{2, Stranger::silent, nullptr}, Case{2, Stranger::garbage, &seal},
                       Case{3, Stranger::silent, &seal}}) {
    SCOPED_TRACE(::testing::Message() << "world " << c.world
                                      << (c.kind == Stranger::garbage ? ", garbage" : ", silent"));
    const auto store = c10::make_intrusive<StrangerOnTheNetwork>(c.world, /*attacked_tries=*/1, c.kind);
    const auto joined = join_all(store, c.world, c.seal, "");
    EXPECT_EQ(store->unread(), 0) << "the stranger could not read Gloo's rendezvous";
    ASSERT_EQ(store->held().size(), size_t(c.world * (c.world - 1))) << "a member's port refused the stranger";
    EXPECT_EQ(store->tries(), 2);
    for (const auto& j : joined) EXPECT_LT(j.seconds, kGreetingGrace.count() + 10.0);
    for (const int fd : store->held()) EXPECT_TRUE(closed_by_the_member(fd)) << "a stranger's connection is still held";
    expect_a_working_group(joined);
  }
}

// A stranger that wins every try: the members give up within the timeout,
// all of them, with one line that says what may be going on.
TEST(GlooGroup, AStrangerOnEveryTryEndsTheFormationInBoundedTime) {
  const auto timeout = std::chrono::seconds(12);
  const auto store = c10::make_intrusive<StrangerOnTheNetwork>(2, kGroupAttempts, Stranger::silent);
  const auto joined = join_all(store, 2, nullptr, "", timeout);
  EXPECT_GE(store->tries(), 2);
  for (const auto& j : joined) {
    EXPECT_FALSE(j.group);
    EXPECT_LT(j.seconds, timeout.count() + 5.0);
    EXPECT_NE(j.error.find("a process that is not a member"), std::string::npos) << j.error;
    EXPECT_NE(j.error.find(fmt::format("({} tries)", store->tries())), std::string::npos) << j.error;
    EXPECT_EQ(j.error.find('\n'), std::string::npos) << j.error;
  }
}
