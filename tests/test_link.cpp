// Issue 81: links between workers, ours: the handshake, sealed frames, both
// directions at once, strangers, the three routes (direct, a punched hole,
// a relay) on loopback, the link book over a store, and the routes that home
// routers of each NAT kind allow (scripts/wan_testbed.sh: root only).
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <functional>
#include <future>
#include <mutex>
#include <thread>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include "comm/link/link_book.h"
#include "comm/link/socket_io.h"
#include "comm/store/run_keys.h"
#include "test_util.h"
#include "wan_testbed.h"

using namespace noloco;
using noloco::testing::run_command;
using noloco::testing::WanTestbed;

namespace {

const LinkKey kKey = run_key("link-test", "link");
const RelayKey kRelayKey = run_key("link-test", "relay");

LinkEndpointOptions on_loopback(std::vector<std::string> relays = {}) {
  LinkEndpointOptions o;
  o.relays = std::move(relays);
  return o;
}

// A socket listening on a free loopback port, its address in `at`; -1 if none.
int loopback_listener(sockaddr_in* at) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  *at = {};
  at->sin_family = AF_INET;
  at->sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t size = sizeof(*at);
  if (::bind(fd, reinterpret_cast<sockaddr*>(at), sizeof(*at)) != 0 || ::listen(fd, 1) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(at), &size) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

// What a->b carries before its first message's frame: the hello and the proof, then the stream's header.
constexpr size_t kBeforeFirstFrame = link_wire::kHelloBytes + link_wire::kProofBytes + Link::kStreamHeaderBytes;

// Both ends open at once (as two workers do after meeting); {dialer's, acceptor's}.
std::pair<LinkPtr, LinkPtr> open_both(LinkEndpoint& a, LinkEndpoint& b, LinkAddresses a_seen, LinkAddresses b_seen,
                                      std::string* problem, std::chrono::seconds within = std::chrono::seconds(20)) {
  const LinkEnd ea{"test", 0, 0}, eb{"test", 1, 0};
  a.serve(ea);
  b.serve(eb);
  const auto deadline = Clock::now() + within;
  std::string other_problem;
  auto from_b = std::async(std::launch::async, [&] { return b.open(eb, ea, a_seen, "0", deadline, nullptr, &other_problem); });
  auto from_a = a.open(ea, eb, b_seen, "0", deadline, nullptr, problem);
  auto other = from_b.get();
  if (!other_problem.empty()) *problem += " | " + other_problem;
  return {from_a, other};
}

// Both ends send `n` bytes at once and receive the other's; true if each got the other's bytes.
bool trade(Link& a, Link& b, size_t n) {
  std::vector<uint8_t> to_b(n), to_a(n), at_a(n), at_b(n);
  for (size_t i = 0; i < n; ++i) to_b[i] = uint8_t(i * 7), to_a[i] = uint8_t(i * 13 + 1);
  const auto deadline = Clock::now() + std::chrono::seconds(20);
  auto sent_a = std::async(std::launch::async, [&] { return a.send({{to_b.data(), n / 3}, {to_b.data() + n / 3, n - n / 3}}, deadline); });
  auto sent_b = std::async(std::launch::async, [&] { return b.send({{to_a.data(), n}}, deadline); });
  auto got_b = std::async(std::launch::async, [&] { return b.receive(at_b.data(), n, deadline); });
  const auto got_a = a.receive(at_a.data(), n, deadline);
  return sent_a.get() && sent_b.get() && got_a == int64_t(n) && got_b.get() == int64_t(n) && at_a == to_a && at_b == to_b;
}

// A man in the middle between a and b (its listener is the address a dials
// for b): b->a goes through as it comes, a->b as `forward(from_a, to_b)`
// carries it. Joined when it goes: its sockets are closed by then.
class OnPathProxy {
 public:
  OnPathProxy(const LinkEndpoint& b, std::function<void(int from_a, int to_b)> forward)
      : listener_(loopback_listener(&at_)) {
    if (listener_ < 0) return;
    thread_ = std::thread([this, port = b.port(), forward = std::move(forward)] {
      const int from_a = ::accept(listener_, nullptr, nullptr);
      const int to_b = ::socket(AF_INET, SOCK_STREAM, 0);
      sockaddr_in b_at{};
      b_at.sin_family = AF_INET;
      b_at.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
      b_at.sin_port = htons(uint16_t(port));
      if (from_a >= 0 && ::connect(to_b, reinterpret_cast<sockaddr*>(&b_at), sizeof(b_at)) == 0) {
        std::thread back([&] {
          std::vector<uint8_t> buffer(4096);
          for (ssize_t n; (n = ::read(to_b, buffer.data(), buffer.size())) > 0;) ::write(from_a, buffer.data(), size_t(n));
          ::shutdown(from_a, SHUT_WR);
        });
        forward(from_a, to_b);
        ::shutdown(to_b, SHUT_WR);
        back.join();
      }
      if (from_a >= 0) ::close(from_a);
      ::close(to_b);
    });
  }
  ~OnPathProxy() {
    if (thread_.joinable()) thread_.join();
    if (listener_ >= 0) ::close(listener_);
  }
  bool ok() const { return listener_ >= 0; }
  std::string address() const { return fmt::format("127.0.0.1:{}", ntohs(at_.sin_port)); }

 private:
  sockaddr_in at_{};
  int listener_;
  std::thread thread_;
};

// A man in the middle in front of a relay: every connection to it goes on
// to `relay` as it comes, except the relay's answer to a reflection, whose
// address it rewrites to `aim` (where it would have the run's punches go).
class ReflectionRewriter {
 public:
  ReflectionRewriter(int relay_port, const sockaddr_in& aim) : listener_(loopback_listener(&at_)) {
    if (listener_ < 0) return;
    thread_ = std::thread([this, relay_port, aim] {
      while (!stopping_) {
        pollfd p{listener_, POLLIN, 0};
        if (::poll(&p, 1, 50) != 1) continue;
        const int client = ::accept(listener_, nullptr, nullptr);
        if (client < 0) continue;
        const int relay = ::socket(AF_INET, SOCK_STREAM, 0);
        sockaddr_in relay_at{};
        relay_at.sin_family = AF_INET;
        relay_at.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        relay_at.sin_port = htons(uint16_t(relay_port));
        for (int fd : {client, relay}) {
          const timeval five{5, 0};
          ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &five, sizeof(five));
        }
        if (::connect(relay, reinterpret_cast<sockaddr*>(&relay_at), sizeof(relay_at)) != 0) {
          ::close(client);
          ::close(relay);
          continue;
        }
        std::lock_guard<std::mutex> lock(mutex_);
        open_.push_back(client);
        open_.push_back(relay);
        carriers_.emplace_back([this, client, relay, aim] { carry(client, relay, aim); });
      }
    });
  }
  ~ReflectionRewriter() {
    stopping_ = true;
    if (thread_.joinable()) thread_.join();
    {
      std::lock_guard<std::mutex> lock(mutex_);
      for (int fd : open_) ::shutdown(fd, SHUT_RDWR);
    }
    for (auto& c : carriers_) c.join();
    for (int fd : open_) ::close(fd);
    if (listener_ >= 0) ::close(listener_);
  }
  bool ok() const { return listener_ >= 0; }
  std::string address() const { return fmt::format("127.0.0.1:{}", ntohs(at_.sin_port)); }
  int rewritten() const { return rewritten_; }

 private:
  static bool pass(int from, int to, uint8_t* buffer, size_t n) {
    for (size_t got = 0; got < n;) {
      const ssize_t r = ::read(from, buffer + got, n - got);
      if (r <= 0) return false;
      got += size_t(r);
    }
    return ::write(to, buffer, n) == ssize_t(n);
  }
  void carry(int client, int relay, const sockaddr_in& aim) {
    std::array<uint8_t, relay_wire::kRequestBytes + relay_wire::kReflectionBytes> buffer{};
    if (!pass(relay, client, buffer.data(), relay_wire::kChallengeBytes) ||
        !pass(client, relay, buffer.data(), relay_wire::kRequestBytes))
      return;
    if (buffer[0] == relay_wire::kReflect) {
      std::array<uint8_t, relay_wire::kReflectionBytes> answer{};
      for (size_t got = 0; got < answer.size();) {
        const ssize_t r = ::read(relay, answer.data() + got, answer.size() - got);
        if (r <= 0) return;
        got += size_t(r);
      }
      std::memcpy(answer.data(), &aim.sin_addr, 4);
      std::memcpy(answer.data() + 4, &aim.sin_port, 2);
      ++rewritten_;
      (void)!::write(client, answer.data(), answer.size());
      ::shutdown(client, SHUT_WR);
      return;
    }
    std::thread back([&] {
      std::vector<uint8_t> chunk(4096);
      for (ssize_t n; (n = ::read(relay, chunk.data(), chunk.size())) > 0;) ::write(client, chunk.data(), size_t(n));
      ::shutdown(client, SHUT_WR);
    });
    std::vector<uint8_t> chunk(4096);
    for (ssize_t n; (n = ::read(client, chunk.data(), chunk.size())) > 0;) ::write(relay, chunk.data(), size_t(n));
    ::shutdown(relay, SHUT_WR);
    back.join();
  }

  sockaddr_in at_{};
  int listener_;
  std::atomic<bool> stopping_{false};
  std::atomic<int> rewritten_{0};
  std::mutex mutex_;
  std::vector<int> open_;
  std::vector<std::thread> carriers_;
  std::thread thread_;
};

// a and b open a link, a dialing b through `proxy`.
std::pair<LinkPtr, LinkPtr> open_through(const OnPathProxy& proxy, LinkEndpoint& a, LinkEndpoint& b,
                                         std::string* problem) {
  if (!proxy.ok()) {
    *problem = "the proxy has no listener";
    return {};
  }
  auto b_seen = b.addresses();
  b_seen.listen = proxy.address();
  return open_both(a, b, a.addresses(), b_seen, problem);
}

}  // namespace

TEST(Links, TwoWorkersOpenOneSealedLinkAndTradeBothWaysAtOnce) {
  LinkEndpoint a(on_loopback(), kKey, kRelayKey), b(on_loopback(), kKey, kRelayKey);
  std::string problem;
  const auto [da, db] = open_both(a, b, a.addresses(), b.addresses(), &problem);
  ASSERT_TRUE(da && db) << problem;
  EXPECT_EQ(da->route(), LinkRoute::direct);
  EXPECT_EQ(da->id(), db->id()) << "both ends name the link alike";
  EXPECT_TRUE(trade(*da, *db, 3 * Link::kMaxChunk + 5));  // several frames, the last one short
  EXPECT_TRUE(trade(*da, *db, 0)) << "an empty message is a message";
  EXPECT_GT(da->bytes_sent(), 3 * Link::kMaxChunk);
  // A second link between the same ends is another link.
  const auto [again, again_b] = open_both(a, b, a.addresses(), b.addresses(), &problem);
  ASSERT_TRUE(again && again_b) << problem;
  EXPECT_NE(again->id(), da->id());
}

// A link's sockets choose CUBIC before they connect, whatever the kernel's
// default (BBR here): both ways at once through FIFO uplinks, BBR left them
// idle, and a connection established under BBR keeps BBR's pacing after a
// switch (comm/link/socket_io.h, docs/several-machines.md's table). A
// listener's choice is what its accepted connections run under.
TEST(Links, ALinksSocketsChooseCubicBeforeTheyConnectAndAcceptedOnesInheritIt) {
  if (noloco::testing::read_text("/proc/sys/net/ipv4/tcp_available_congestion_control").find("cubic") ==
      std::string::npos)
    GTEST_SKIP() << "this kernel has no CUBIC";
  const auto congestion_control = [](int fd) {
    char name[16] = {};
    socklen_t length = sizeof(name);
    return ::getsockopt(fd, IPPROTO_TCP, TCP_CONGESTION, name, &length) == 0 ? std::string(name) : "?";
  };
  const int listener = tcp_socket(), dialer = tcp_socket();
  ASSERT_GE(listener, 0);
  ASSERT_GE(dialer, 0);
  EXPECT_EQ(congestion_control(dialer), "cubic");  // before any connection
  sockaddr_in at{};
  at.sin_family = AF_INET;
  at.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t size = sizeof(at);
  ASSERT_EQ(::bind(listener, reinterpret_cast<sockaddr*>(&at), sizeof(at)), 0);
  ASSERT_EQ(::listen(listener, 1), 0);
  ASSERT_EQ(::getsockname(listener, reinterpret_cast<sockaddr*>(&at), &size), 0);
  ASSERT_TRUE(::connect(dialer, reinterpret_cast<sockaddr*>(&at), sizeof(at)) == 0 || errno == EINPROGRESS);
  ASSERT_TRUE(wait_connected(dialer, Clock::now() + std::chrono::seconds(5)));
  ASSERT_TRUE(wait_for(listener, POLLIN, Clock::now() + std::chrono::seconds(5)));
  const int accepted = ::accept(listener, nullptr, nullptr);
  ASSERT_GE(accepted, 0);
  EXPECT_EQ(congestion_control(accepted), "cubic");
  EXPECT_EQ(congestion_control(dialer), "cubic");
  ::close(accepted);
  ::close(dialer);
  ::close(listener);
}

// Links sending at once split the uplink's 95% evenly, each socket paced by
// the kernel at its share; one that stops hands its share back.
TEST(Links, LinksSendingAtOnceSplitTheUplinkAndEachSocketIsPacedAtItsShare) {
  const auto pacing = [](int fd) {
    unsigned int rate = 0;
    socklen_t length = sizeof(rate);
    return ::getsockopt(fd, SOL_SOCKET, SO_MAX_PACING_RATE, &rate, &length) == 0 ? double(rate) : -1.0;
  };
  const int a = tcp_socket(), b = tcp_socket();
  ASSERT_GE(a, 0);
  ASSERT_GE(b, 0);
  const double unpaced = pacing(a);
  UplinkShare share(8e6);  // 1 MB/s
  EXPECT_DOUBLE_EQ(share.each(), 950e3);
  {
    const UplinkShare::Sending sending_a(&share, a);
    EXPECT_DOUBLE_EQ(pacing(a), 950e3);
    EXPECT_EQ(pacing(b), unpaced);
    {
      const UplinkShare::Sending sending_b(&share, b);
      EXPECT_DOUBLE_EQ(pacing(a), 475e3);
      EXPECT_DOUBLE_EQ(pacing(b), 475e3);
      EXPECT_DOUBLE_EQ(share.each(), 475e3);
    }
    EXPECT_DOUBLE_EQ(pacing(a), 950e3) << "b stopped: a has it all";
  }
  UplinkShare none(0);
  { const UplinkShare::Sending sending(&none, b); }
  { const UplinkShare::Sending sending(nullptr, b); }
  EXPECT_EQ(pacing(b), 475e3) << "no uplink given: the socket is left as it was";
  ::close(a);
  ::close(b);
}

// A link through a relay leaves no faster than its share of the uplink its
// endpoint was told: 500 kB at 95% of 8 Mbit/s take 0.53 s to arrive, where
// on loopback they would otherwise take a millisecond. The kernel paces a
// connection only after its first ten segments (of 64 kB on loopback), so a
// first message takes those; the second is timed, and held to half its paced
// time, a lower bound only.
TEST(Links, ARelayedLinkLeavesNoFasterThanTheUplinkItsEndpointWasTold) {
  RelayServer relay("127.0.0.1", 0, kRelayKey);
  auto paced = on_loopback({fmt::format("127.0.0.1:{}", relay.port())});
  const auto unpaced = paced;
  paced.uplink = 8e6;
  LinkEndpoint a(paced, kKey, kRelayKey), b(unpaced, kKey, kRelayKey);
  std::string problem;
  const auto [da, db] = open_both(a, b, LinkAddresses{}, LinkAddresses{}, &problem);
  ASSERT_TRUE(da && db) << problem;
  ASSERT_EQ(da->route(), LinkRoute::relayed);
  EXPECT_TRUE(da->shares_uplink());
  EXPECT_FALSE(db->shares_uplink()) << "b was told no uplink";
  const size_t first = 1'000'000, timed = 500'000;
  std::vector<uint8_t> out(first, 7), in(first);
  const auto deadline = Clock::now() + std::chrono::seconds(20);
  auto sent = std::async(std::launch::async, [&] {
    return da->send({{out.data(), first}}, deadline) && da->send({{out.data(), timed}}, deadline);
  });
  ASSERT_EQ(db->receive(in.data(), first, deadline), int64_t(first));
  const auto start = Clock::now();
  ASSERT_EQ(db->receive(in.data(), timed, deadline), int64_t(timed));
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  EXPECT_TRUE(sent.get());
  EXPECT_GE(seconds, 0.5 * timed / 950e3) << "paced at 950 kB/s";
}

// A direct link to a peer on the machine's own network (a second machine at
// home, here loopback) does not cross the uplink, and is left unpaced.
TEST(Links, ADirectLinkToAPeerOnTheLocalNetworkLeavesTheUplinkAlone) {
  auto told = on_loopback();
  told.uplink = 8e6;
  LinkEndpoint a(told, kKey, kRelayKey), b(told, kKey, kRelayKey);
  std::string problem;
  const auto [da, db] = open_both(a, b, a.addresses(), b.addresses(), &problem);
  ASSERT_TRUE(da && db) << problem;
  EXPECT_EQ(da->route(), LinkRoute::direct);
  EXPECT_TRUE(da->far_end_on_local_network());
  EXPECT_FALSE(da->shares_uplink());
  EXPECT_FALSE(db->shares_uplink());
}

TEST(Links, LocalNetworksAreLoopbackPrivateRangesAndLinkLocal) {
  const auto local = [](const char* dotted) {
    in_addr a{};
    ::inet_pton(AF_INET, dotted, &a);
    return local_network_address(ntohl(a.s_addr));
  };
  for (const char* yes : {"127.0.0.1", "10.0.0.2", "172.16.0.1", "172.31.255.254", "192.168.1.20", "169.254.3.4"})
    EXPECT_TRUE(local(yes)) << yes;
  for (const char* no : {"100.64.1.2", "172.32.0.1", "172.15.0.1", "192.169.0.1", "198.51.100.1", "8.8.8.8", "11.0.0.1"})
    EXPECT_FALSE(local(no)) << no;
}

// An evaluation one end gave up leaves the link its partner dialed for it
// unclaimed at the listener; the pair's next attempt must not take it (its
// dialer closed it), or every later attempt would take the one before's.
TEST(Links, ALinkDialedForAnAttemptItsAcceptorGaveUpIsNotTakenForTheNext) {
  LinkEndpoint a(on_loopback(), kKey, kRelayKey), b(on_loopback(), kKey, kRelayKey);
  const LinkEnd ea{"test", 0, 0}, eb{"test", 1, 0};
  a.serve(ea);
  b.serve(eb);
  std::string problem;
  EXPECT_FALSE(a.open(ea, eb, b.addresses(), "evaluation/60", Clock::now() + std::chrono::seconds(1), nullptr, &problem))
      << "nobody at b took it";
  const auto [da, db] = open_both(a, b, a.addresses(), b.addresses(), &problem);
  ASSERT_TRUE(da && db) << problem;
  EXPECT_EQ(da->id(), db->id()) << "both ends hold the link of this attempt";
  EXPECT_TRUE(trade(*da, *db, 1000));
}

TEST(Links, AWorkerWithAnotherTokenGetsNoLinkAndGivesNone) {
  LinkEndpoint a(on_loopback(), kKey, kRelayKey), b(on_loopback(), run_key("another-run", "link"), kRelayKey);
  std::string problem;
  const auto [da, db] = open_both(a, b, a.addresses(), b.addresses(), &problem, std::chrono::seconds(3));
  EXPECT_FALSE(da);
  EXPECT_FALSE(db);
  EXPECT_NE(problem.find("does not prove the run's token"), std::string::npos) << problem;
}

TEST(Links, AFrameChangedOnTheWayIsNeverDeliveredAndBreaksTheLink) {
  LinkEndpoint a(on_loopback(), kKey, kRelayKey), b(on_loopback(), kKey, kRelayKey);
  std::string problem;
  const auto [da, db] = open_both(a, b, a.addresses(), b.addresses(), &problem);
  ASSERT_TRUE(da && db) << problem;
  std::vector<uint8_t> message(1000, 42), got(1000, 0);
  da->corrupt_next_send();
  ASSERT_TRUE(da->send({{message.data(), message.size()}}, Clock::now() + std::chrono::seconds(5)));
  EXPECT_EQ(db->receive(got.data(), got.size(), Clock::now() + std::chrono::seconds(5)), -1);
  EXPECT_NE(db->problem().find("failed authentication"), std::string::npos) << db->problem();
  EXPECT_TRUE(db->broken());
  EXPECT_EQ(std::count(got.begin(), got.end(), 42), 0) << "nothing of it reached the caller's buffer as valid";
}

// A frame recorded on the way and played again (a man in the middle between
// the two ends, here a proxy in the test): the copy fails to open, and the
// receiver never takes it for a second message.
TEST(Links, AFrameReplayedOnTheWayIsRefusedAndNeverDeliveredTwice) {
  LinkEndpoint a(on_loopback(), kKey, kRelayKey), b(on_loopback(), kKey, kRelayKey);
  constexpr size_t kMessage = 1000;
  const size_t frame = Link::wire_bytes(kMessage, true);
  OnPathProxy proxy(b, [&](int from_a, int to_b) {
    std::vector<uint8_t> seen, buffer(4096);
    for (ssize_t n; seen.size() < kBeforeFirstFrame + frame && (n = ::read(from_a, buffer.data(), buffer.size())) > 0;) {
      seen.insert(seen.end(), buffer.begin(), buffer.begin() + n);
      ::write(to_b, buffer.data(), size_t(n));
    }
    if (seen.size() >= kBeforeFirstFrame + frame) ::write(to_b, seen.data() + kBeforeFirstFrame, frame);  // again
    for (ssize_t n; (n = ::read(from_a, buffer.data(), buffer.size())) > 0;) ::write(to_b, buffer.data(), size_t(n));
  });
  std::string problem;
  auto [da, db] = open_through(proxy, a, b, &problem);
  ASSERT_TRUE(da && db) << problem;
  std::vector<uint8_t> message(kMessage, 42), got(kMessage, 0);
  ASSERT_TRUE(da->send({{message.data(), message.size()}}, Clock::now() + std::chrono::seconds(5)));
  EXPECT_EQ(db->receive(got.data(), got.size(), Clock::now() + std::chrono::seconds(5)), int64_t(kMessage));
  EXPECT_EQ(got, message) << "the original arrives";
  std::fill(got.begin(), got.end(), 0);
  EXPECT_EQ(db->receive(got.data(), got.size(), Clock::now() + std::chrono::seconds(5)), -1);
  EXPECT_TRUE(db->unauthentic()) << db->problem();
  EXPECT_EQ(std::count(got.begin(), got.end(), 42), 0) << "the copy is never handed out";
  da->shut();
  db->shut();
}

// Issue 83 item 9: a peer (or a path) that stops in the middle of a message,
// its connection left open. The receiver's wait ends at its deadline with
// the link broken and nothing of the half message handed out; it does not
// wait for the rest.
TEST(Links, AMessageThatStopsHalfWayEndsTheReceiveAtItsDeadline) {
  LinkEndpoint a(on_loopback(), kKey, kRelayKey), b(on_loopback(), kKey, kRelayKey);
  constexpr size_t kMessage = 100000;
  const size_t half = kBeforeFirstFrame + Link::wire_bytes(kMessage, true) / 2;
  std::promise<void> released;
  auto release = released.get_future().share();
  OnPathProxy proxy(b, [&, release](int from_a, int to_b) {
    std::vector<uint8_t> buffer(4096);
    for (size_t passed = 0; passed < half;) {
      const ssize_t n = ::read(from_a, buffer.data(), std::min(buffer.size(), half - passed));
      if (n <= 0) return;
      ::write(to_b, buffer.data(), size_t(n));
      passed += size_t(n);
    }
    release.wait();  // the rest is held, the connection open
  });
  struct ReleaseWhenDone {  // before the proxy is joined, also when an assertion ends the test early
    std::promise<void>& released;
    ~ReleaseWhenDone() { released.set_value(); }
  } release_when_done{released};
  std::string problem;
  auto [da, db] = open_through(proxy, a, b, &problem);
  ASSERT_TRUE(da && db) << problem;
  std::vector<uint8_t> message(kMessage, 42), got(kMessage, 0);
  ASSERT_TRUE(da->send({{message.data(), message.size()}}, Clock::now() + std::chrono::seconds(5)));
  EXPECT_EQ(db->receive(got.data(), got.size(), Clock::now() + std::chrono::seconds(2)), -1);
  EXPECT_TRUE(db->broken()) << db->problem();
  EXPECT_NE(db->problem().find("in time"), std::string::npos) << db->problem();
  EXPECT_EQ(std::count(got.begin(), got.end(), 42), 0) << "nothing of the half message is handed out";
  da->shut();
  db->shut();
}

TEST(Links, AMessageLargerThanExpectedBreaksTheLinkInsteadOfOverflowing) {
  LinkEndpoint a(on_loopback(), kKey, kRelayKey), b(on_loopback(), kKey, kRelayKey);
  std::string problem;
  const auto [da, db] = open_both(a, b, a.addresses(), b.addresses(), &problem);
  ASSERT_TRUE(da && db) << problem;
  std::vector<uint8_t> message(4096, 1), got(1024);
  ASSERT_TRUE(da->send({{message.data(), message.size()}}, Clock::now() + std::chrono::seconds(5)));
  EXPECT_EQ(db->receive(got.data(), got.size(), Clock::now() + std::chrono::seconds(5)), -1);
  EXPECT_NE(db->problem().find("larger than the 1024 bytes expected"), std::string::npos) << db->problem();
}

TEST(Links, AThousandIdleStrangersAndNoiseAtTheListenerKeepNoMemberOut) {
  LinkEndpoint a(on_loopback(), kKey, kRelayKey), b(on_loopback(), kKey, kRelayKey);
  sockaddr_in to{};
  to.sin_family = AF_INET;
  to.sin_port = htons(uint16_t(b.port()));
  to.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  std::vector<int> strangers;
  for (int i = 0; i < 1000; ++i) {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    ASSERT_EQ(::connect(fd, reinterpret_cast<const sockaddr*>(&to), sizeof(to)), 0);
    if (i % 100 == 0) {  // a hello's worth of noise
      const std::vector<uint8_t> noise(link_wire::kHelloBytes, uint8_t(i));
      (void)!::send(fd, noise.data(), noise.size(), MSG_NOSIGNAL);
    }
    strangers.push_back(fd);
  }
  std::string problem;
  const auto [da, db] = open_both(a, b, a.addresses(), b.addresses(), &problem);
  ASSERT_TRUE(da && db) << problem;
  // Direct: the dial was answered within its window (LinkEndpoint::kDirectWindow), not after the strangers.
  EXPECT_EQ(da->route(), LinkRoute::direct);
  EXPECT_TRUE(trade(*da, *db, 1 << 16));
  EXPECT_GE(b.counts().refused, 10) << "the noisy strangers were refused";
  for (int fd : strangers) ::close(fd);
}

// A peer whose listener cannot be reached (behind NAT) and through whose
// router no hole goes: the relay splices the two ends, which it cannot read.
// The relay also told each end where it sees it come from.
TEST(Links, WithoutADirectWayOrAHoleThePairGoesThroughTheRelay) {
  RelayServer relay("127.0.0.1", 0, kRelayKey);
  const auto at = fmt::format("127.0.0.1:{}", relay.port());
  LinkEndpoint a(on_loopback({at}), kKey, kRelayKey), b(on_loopback({at}), kKey, kRelayKey);
  EXPECT_EQ(a.addresses().reflexive.rfind("127.0.0.1:", 0), 0u) << a.addresses().reflexive;
  EXPECT_EQ(relay.stats().reflected, 2);
  std::string problem;
  const auto [da, db] = open_both(a, b, LinkAddresses{}, LinkAddresses{}, &problem);
  ASSERT_TRUE(da && db) << problem;
  EXPECT_EQ(da->route(), LinkRoute::relayed);
  EXPECT_EQ(db->route(), LinkRoute::relayed);
  EXPECT_EQ(da->relay(), at);
  EXPECT_TRUE(trade(*da, *db, 1 << 20));
  EXPECT_EQ(relay.stats().spliced, 1);
  EXPECT_GE(relay.stats().bytes, 2 << 20);
}

// Issue 83's probe of the punch: whoever answers at the address a hole is
// punched to may be a stranger that accepts and then says nothing. The
// dialer gives it up after the punch's window and the pair still gets its
// link through the relay, well inside the pair's deadline.
TEST(Links, AStrangerWhoAnswersThePunchAndSaysNothingLeavesThePairToTheRelay) {
  RelayServer relay("127.0.0.1", 0, kRelayKey);
  const auto at = fmt::format("127.0.0.1:{}", relay.port());
  LinkEndpoint a(on_loopback({at}), kKey, kRelayKey), b(on_loopback({at}), kKey, kRelayKey);
  sockaddr_in stranger_at{};
  const int stranger = loopback_listener(&stranger_at);
  ASSERT_GE(stranger, 0);
  LinkAddresses b_seen;  // where a punches to: the stranger
  b_seen.reflexive = fmt::format("127.0.0.1:{}", ntohs(stranger_at.sin_port));
  std::string problem;
  const auto [da, db] = open_both(a, b, LinkAddresses{}, b_seen, &problem, std::chrono::seconds(15));
  pollfd answered{stranger, POLLIN, 0};
  EXPECT_EQ(::poll(&answered, 1, 0), 1) << "the punch reached the stranger";
  ASSERT_TRUE(da && db) << problem;
  EXPECT_EQ(da->route(), LinkRoute::relayed);
  EXPECT_TRUE(trade(*da, *db, 1 << 16));
  ::close(stranger);
}

// Issue 83 item 9: an on-path rewrite of the relay's answer to "where do you
// see me" would aim the run's punches at a third party. The answer carries
// the relay's proof over this connection's challenge, so a rewritten one is
// refused: that worker punches nowhere, the third party hears nothing, and
// the pair still gets its link through the relay.
TEST(Links, ARewrittenReflectionIsRefusedAndAimsNoPunch) {
  RelayServer relay("127.0.0.1", 0, kRelayKey);
  sockaddr_in third_party_at{};
  const int third_party = loopback_listener(&third_party_at);
  ASSERT_GE(third_party, 0);
  ReflectionRewriter rewriter(relay.port(), third_party_at);
  ASSERT_TRUE(rewriter.ok());
  LinkEndpoint a(on_loopback({fmt::format("127.0.0.1:{}", relay.port())}), kKey, kRelayKey),
      b(on_loopback({rewriter.address()}), kKey, kRelayKey);
  EXPECT_GE(rewriter.rewritten(), 1);
  EXPECT_EQ(relay.stats().reflected, rewriter.rewritten() + 1) << "the relay answered both";
  EXPECT_EQ(a.addresses().reflexive.rfind("127.0.0.1:", 0), 0u) << a.addresses().reflexive;
  EXPECT_EQ(b.addresses().reflexive, "") << "a rewritten answer is not taken";
  auto a_seen = a.addresses(), b_seen = b.addresses();
  a_seen.listen = b_seen.listen = "";  // neither reachable directly: punch, else relay
  std::string problem;
  const auto [da, db] = open_both(a, b, a_seen, b_seen, &problem, std::chrono::seconds(15));
  ASSERT_TRUE(da && db) << problem;
  EXPECT_EQ(da->route(), LinkRoute::relayed);
  EXPECT_TRUE(trade(*da, *db, 1 << 16));
  pollfd reached{third_party, POLLIN, 0};
  EXPECT_EQ(::poll(&reached, 1, 0), 0) << "no punch went to the third party";
  ::close(third_party);
}

// The book publishes where its member is reached and keeps the link while
// both ends hold the same one: what the meeting before an exchange checks.
TEST(Links, ABookReusesTheLinkBothEndsHoldAndOpensANewOneOtherwise) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  auto ea = std::make_shared<LinkEndpoint>(on_loopback(), kKey, kRelayKey);
  auto eb = std::make_shared<LinkEndpoint>(on_loopback(), kKey, kRelayKey);
  LinkBook a(store, "link-test", {"replicas", 0, 0}, ea), b(store, "link-test", {"replicas", 1, 0}, eb);
  const auto deadline = Clock::now() + std::chrono::seconds(10);
  std::string pa, pb;
  auto open = [&](int64_t a_theirs, int64_t b_theirs) {
    auto lb = std::async(std::launch::async, [&] { return b.link_to(a.self(), b_theirs, "x", deadline, nullptr, &pb); });
    auto la = a.link_to(b.self(), a_theirs, "x", deadline, nullptr, &pa);
    return std::make_pair(la, lb.get());
  };
  const auto [la, lb] = open(0, 0);
  ASSERT_TRUE(la && lb) << pa << " | " << pb;
  EXPECT_EQ(a.held(b.self()), la->id());
  EXPECT_EQ(b.held(a.self()), la->id());
  // Both announce the same link: it is kept, no new one is opened.
  const auto [same_a, same_b] = open(b.held(a.self()), a.held(b.self()));
  EXPECT_EQ(same_a, la);
  EXPECT_EQ(same_b, lb);
  // One end lost its link (forgot it after a failure): both open a new one.
  b.forget(a.self());
  EXPECT_EQ(b.held(a.self()), 0);
  const auto [new_a, new_b] = open(b.held(a.self()), a.held(b.self()));
  ASSERT_TRUE(new_a && new_b) << pa << " | " << pb;
  EXPECT_NE(new_a->id(), la->id());
  EXPECT_EQ(new_a->id(), new_b->id());
  EXPECT_TRUE(trade(*new_a, *new_b, 4096));
}

namespace {

// Two homes on the same LAN address behind routers of NAT kind `nat`, a
// relay on the public host; each home's link_probe opens its link to the
// other and trades `mb` MB each way `rounds` times. The two ends' JSON lines.
std::vector<nlohmann::json> probe_homes(const std::string& nat, double mb, int rounds) {
  const WanTestbed bed(2, fmt::format("nk{}", ::getpid() % 1000), true, "NLW_UPLINK=off NLW_DOWNLINK=off NLW_NAT=" + nat);
  EXPECT_TRUE(bed.ok()) << bed.why();
  if (!bed.ok()) return {};
  const auto dir = std::filesystem::temp_directory_path() / fmt::format("noloco_links_{}_{}", ::getpid(), nat);
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  const auto script = dir / "homes.sh";
  noloco::testing::write_text(
      script, fmt::format("{pub} {probe} relay 198.51.100.1 7700 > {dir}/relay.out 2>&1 &\nrelay=$!\nsleep 0.3\n"
                          "{h1} {probe} end {dir} a b 0 10.0.0.2 198.51.100.1:7700 {mb} {rounds} > {dir}/a.out 2>&1 &\n"
                          "{h2} {probe} end {dir} b a 1 10.0.0.2 198.51.100.1:7700 {mb} {rounds} > {dir}/b.out 2>&1 &\n"
                          "wait %2 %3; kill -TERM $relay; wait $relay\n",
                          fmt::arg("pub", bed.in("pub")), fmt::arg("h1", bed.in("h1")), fmt::arg("h2", bed.in("h2")),
                          fmt::arg("probe", NOLOCO_LINK_PROBE), fmt::arg("dir", dir.string()), fmt::arg("mb", mb),
                          fmt::arg("rounds", rounds)));
  const auto ran = run_command(fmt::format("timeout -k 5 90 bash {}", script.string()), 100);
  EXPECT_EQ(ran.exit_code, 0) << ran.output;
  std::vector<nlohmann::json> ends;
  for (const auto* name : {"a", "b"}) {
    const auto text = noloco::testing::read_text(dir / fmt::format("{}.out", name));
    try {
      ends.push_back(nlohmann::json::parse(text));
    } catch (const std::exception&) {
      ADD_FAILURE() << name << ": " << text;
    }
  }
  std::filesystem::remove_all(dir);
  return ends;
}

}  // namespace

class LinkRoutes : public ::testing::Test {
 protected:
  void SetUp() override {
    if (const auto why = noloco::testing::why_no_testbed(); !why.empty()) GTEST_SKIP() << why;
  }
};

// Routers that keep a connection's port (endpoint-independent mapping) and
// drop what they were not asked for: the homes punch a hole and nothing
// crosses the relay, though both machines have the same LAN address.
TEST_F(LinkRoutes, HomesBehindEndpointIndependentNatPunchAHole) {
  const auto ends = probe_homes("eim", 1, 2);
  ASSERT_EQ(ends.size(), 2u);
  for (const auto& e : ends) {
    EXPECT_EQ(e.value("route", ""), "punched") << e.dump();
    EXPECT_EQ(e.value("reflexive", "").rfind("100.64.", 0), 0u) << "the router's public address: " << e.dump();
    EXPECT_EQ(e["seconds"].size(), 2u);
  }
}

// Routers that map every connection to a new port (symmetric-like): no hole
// opens (each end aims at the port its router gave the connection to the
// relay, which is not the one it gives the next), and the pair goes through
// the relay within its windows.
TEST_F(LinkRoutes, HomesBehindSymmetricNatGoThroughTheRelay) {
  const auto ends = probe_homes("random", 1, 2);
  ASSERT_EQ(ends.size(), 2u);
  for (const auto& e : ends) {
    EXPECT_EQ(e.value("route", ""), "relayed") << e.dump();
    EXPECT_EQ(e.value("relay", ""), "198.51.100.1:7700") << e.dump();
    EXPECT_EQ(e.value("reflexive", "").rfind("100.64.", 0), 0u) << "the punch was tried: " << e.dump();
    EXPECT_EQ(e["seconds"].size(), 2u);
  }
}
