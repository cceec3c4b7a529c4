// Issue 66: the relay that carries the Gloo pairs of workers who can only
// connect out, and runs across a testbed of homes behind NAT routers
// (scripts/wan_testbed.sh, network namespaces: root only).
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <thread>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "comm/store/run_keys.h"
#include "comm/transport/relay.h"
#include "util/files.h"
#include "test_util.h"

using namespace noloco;
using noloco::testing::metrics_records;

using noloco::testing::run_command;
using Clock = std::chrono::steady_clock;

namespace {

sockaddr_storage loopback(int port) {
  sockaddr_storage address{};
  auto* in = reinterpret_cast<sockaddr_in*>(&address);
  in->sin_family = AF_INET;
  in->sin_port = htons(uint16_t(port));
  in->sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  return address;
}

// One byte from `fd` within `seconds`; -1 on EOF, error or timeout.
int read_byte(int fd, int seconds) {
  pollfd p{fd, POLLIN, 0};
  if (::poll(&p, 1, seconds * 1000) != 1) return -1;
  uint8_t b = 0;
  return ::recv(fd, &b, 1, 0) == 1 ? b : -1;
}

// A connection that has proved `key` for `op` on listener `id`, or -1.
int request(int port, const RelayKey& key, uint8_t op, const ListenerId& id) {
  return relay_request(loopback(port), key, op, id, Clock::now() + std::chrono::seconds(5));
}

}  // namespace

TEST(Relay, SplicesAParkedListenerWithItsDialerAndCarriesBytesBothWays) {
  const auto key = run_key("relay-test", "relay");
  RelayServer relay("127.0.0.1", 0, key);
  const ListenerId id{1, 2, 3, 4, 5, 6, 7, 8}, other{8, 7, 6, 5, 4, 3, 2, 1};
  const int listener = request(relay.port(), key, relay_wire::kPark, id);
  const int stranger_dialer = request(relay.port(), key, relay_wire::kDial, other);  // nobody parked there
  const int dialer = request(relay.port(), key, relay_wire::kDial, id);
  ASSERT_GE(listener, 0);
  ASSERT_GE(dialer, 0);
  EXPECT_EQ(read_byte(listener, 5), relay_wire::kJoined);
  EXPECT_EQ(read_byte(dialer, 5), relay_wire::kJoined);
  const uint8_t ping = 'x', pong = 'y';
  ASSERT_EQ(::send(dialer, &ping, 1, MSG_NOSIGNAL), 1);
  EXPECT_EQ(read_byte(listener, 5), 'x');
  ASSERT_EQ(::send(listener, &pong, 1, MSG_NOSIGNAL), 1);
  EXPECT_EQ(read_byte(dialer, 5), 'y');
  EXPECT_EQ(relay.stats().spliced, 1);
  // One end goes: the other sees its connection close, as a lost peer.
  ::close(listener);
  EXPECT_EQ(read_byte(dialer, 5), -1);
  ::close(dialer);
  // A dialer whose listener never parks is dropped after the relay's wait.
  EXPECT_EQ(read_byte(stranger_dialer, 15), -1);
  ::close(stranger_dialer);
  EXPECT_EQ(relay.stats().spliced, 1);
}

// Only holders of the run's token get anything from the relay: a client with
// another run's key, one that sends garbage and one that says nothing are
// closed, and none of them reaches a parked listener.
TEST(Relay, RefusesClientsWithoutTheTokenAndHoldsAThousandIdleStrangersWithoutStalling) {
  const auto key = run_key("relay-test", "relay");
  RelayServer relay("127.0.0.1", 0, key);
  const ListenerId id{9, 9, 9, 9, 9, 9, 9, 9};
  const int listener = request(relay.port(), key, relay_wire::kPark, id);
  ASSERT_GE(listener, 0);
  const int impostor = request(relay.port(), run_key("another-run", "relay"), relay_wire::kDial, id);
  ASSERT_GE(impostor, 0);  // connected and sent its request: the relay judges it
  EXPECT_EQ(read_byte(impostor, 5), -1) << "closed, not joined";
  // A thousand strangers connect and say nothing.
  std::vector<int> idle;
  for (int i = 0; i < 1000; ++i) {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    const auto to = loopback(relay.port());
    ASSERT_EQ(::connect(fd, reinterpret_cast<const sockaddr*>(&to), sizeof(sockaddr_in)), 0);
    idle.push_back(fd);
  }
  // A member still gets its pair joined at once.
  const auto start = Clock::now();
  const int dialer = request(relay.port(), key, relay_wire::kDial, id);
  ASSERT_GE(dialer, 0);
  EXPECT_EQ(read_byte(dialer, 5), relay_wire::kJoined);
  EXPECT_EQ(read_byte(listener, 5), relay_wire::kJoined);
  EXPECT_LT(std::chrono::duration<double>(Clock::now() - start).count(), 2.0)
      << "a member waited behind a thousand strangers";
  // The strangers are closed once their window to prove the key has passed.
  int closed = 0;
  for (int fd : idle) {
    uint8_t challenge[relay_wire::kChallengeBytes];
    ASSERT_EQ(::recv(fd, challenge, sizeof(challenge), MSG_WAITALL), ssize_t(sizeof(challenge)));
    closed += read_byte(fd, 10) == -1;
    ::close(fd);
  }
  EXPECT_EQ(closed, 1000);
  EXPECT_GE(relay.stats().refused, 1001);
  for (int fd : {listener, dialer, impostor}) ::close(fd);
}

namespace {

// The testbed of scripts/wan_testbed.sh, removed when the test ends (also on failure).
class WanTestbed {
 public:
  WanTestbed(int homes, const std::string& prefix) : prefix_(prefix) {
    const auto up = run_command(fmt::format(NOLOCO_SOURCE_DIR "/scripts/wan_testbed.sh up {}", homes), 60,
                                fmt::format("NLW_PREFIX={} NLW_SAME_LAN=1", prefix));
    ok_ = up.exit_code == 0;
    why_ = up.output;
  }
  ~WanTestbed() {
    run_command(NOLOCO_SOURCE_DIR "/scripts/wan_testbed.sh down", 60, "NLW_PREFIX=" + prefix_);
  }
  bool ok() const { return ok_; }
  const std::string& why() const { return why_; }
  std::string in(const std::string& host) const { return fmt::format("ip netns exec {}-{} ", prefix_, host); }

 private:
  std::string prefix_, why_;
  bool ok_ = false;
};

class WanRuns : public ::testing::Test {
 protected:
  void SetUp() override {
    if (::geteuid() != 0) GTEST_SKIP() << "the testbed needs root (network namespaces)";
    if (run_command("sh -c 'command -v nft && command -v tc && command -v ip'", 10).exit_code != 0)
      GTEST_SKIP() << "the testbed needs ip, tc and nft (scripts/setup.sh installs them)";
    dir = std::filesystem::temp_directory_path() / fmt::format("noloco_wan_{}", ::getpid());
    std::filesystem::remove_all(dir);
    std::filesystem::create_directories(dir);
    // Worker processes run in other namespaces but see this file system.
    noloco::testing::write_text(dir / "c.txt", noloco::testing::shakespeare(200000));
  }
  void TearDown() override {
    for (const auto& pid : served) run_command("kill -TERM " + pid, 10);
    std::filesystem::remove_all(dir);
  }

  // `noloco serve` on the public host, in the background; its export lines.
  std::string serve(const WanTestbed& bed, const std::string& name, const std::string& args) {
    const auto out = dir / (name + ".out");
    const auto script = dir / (name + ".sh");
    noloco::testing::write_text(script, fmt::format("{} timeout -k 5 600 " NOLOCO_BINARY
                                                    " serve bind=198.51.100.1 {} > {} 2> {}.log &\necho $!\n",
                                                    bed.in("pub"), args, out.string(), out.string()));
    const auto started = run_command("bash " + script.string(), 10);
    EXPECT_EQ(started.exit_code, 0) << started.output;
    served.push_back(started.output.substr(0, started.output.find_first_of("\n")));
    for (int i = 0; i < 300; ++i) {
      const auto text = std::filesystem::exists(out) ? noloco::testing::read_text(out) : "";
      if (text.find("NOLOCO_RELAY") != std::string::npos) return text;
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    ADD_FAILURE() << "serve printed no exports: " << noloco::testing::read_text(out.string() + ".log");
    return "";
  }

  std::filesystem::path dir;
  std::vector<std::string> served;  // serve's process ids
};

}  // namespace

// Issue 66: 4 replicas in 4 homes, every home's machine on the same LAN
// address 10.0.0.2 behind its own masquerading router (nothing gets in), and
// `noloco serve` on the public host: NoLoCo and DiLoCo train with every outer
// step exchanged and end with the losses of the same run on loopback (the
// bytes are the same; only their path differs). Groups of four test what
// pairs alone would not: a relayed connection keeps its listener's address
// for Gloo, else both ends of a pair could decide to dial.
TEST_F(WanRuns, FourHomesBehindNatTrainThroughTheRelayAsOnLoopback) {
  const WanTestbed bed(4, fmt::format("nw{}", ::getpid() % 1000));
  ASSERT_TRUE(bed.ok()) << bed.why();
  const std::string train = noloco::testing::small_train_args((dir / "c.txt").string(), "OUT") +
                            " batch=2 steps=20 outer_interval=5 threads=1 peer_timeout=60";
  for (const std::string method : {"noloco", "diloco"}) {
    // Each run its own serve: its own token, store and relay. Every wait is
    // bounded well inside ctest's 300 s, so the testbed is always removed.
    const int port = method == "noloco" ? 29500 : 29510;
    const auto exports = serve(bed, method + "_serve", fmt::format("port={} relay_port={}", port, port + 1));
    ASSERT_FALSE(exports.empty());
    // Each home its own run directory, as machines without a shared file system have.
    std::string script = exports + "cd " NOLOCO_SOURCE_DIR "\n";
    for (int k = 0; k < 4; ++k) {
      auto args = train;
      args.replace(args.find("OUT"), 3, (dir / fmt::format("{}_h{}", method, k)).string());
      script += fmt::format("RANK={} WORLD_SIZE=4 {} " NOLOCO_BINARY " {} method={} bind=10.0.0.2 > {}/{}_h{}.log 2>&1 &\n",
                            k, bed.in(fmt::format("h{}", k + 1)), args, method, dir.string(), method, k);
    }
    script += "fail=0; for p in $(jobs -p); do wait $p || fail=1; done; exit $fail\n";
    noloco::testing::write_text(dir / "homes.sh", script);
    const auto homes = run_command("timeout -k 5 60 bash " + (dir / "homes.sh").string(), 70);
    std::string logs;
    for (int k = 0; k < 4; ++k) logs += noloco::testing::read_text(dir / fmt::format("{}_h{}.log", method, k));
    ASSERT_EQ(homes.exit_code, 0) << method << ": " << homes.output << logs;
    EXPECT_EQ(logs.find("forming it again"), std::string::npos) << "every group formed at its first try: " << logs;

    auto loopback_args = train;
    loopback_args.replace(loopback_args.find("OUT"), 3, (dir / (method + "_loopback")).string());
    const auto local = noloco::testing::run_cli(loopback_args + " replicas=4 method=" + method, 60);
    ASSERT_EQ(local.exit_code, 0) << local.output;
    for (int k = 0; k < 4; ++k) {
      const auto home = dir / fmt::format("{}_h{}", method, k);
      const auto summary = read_json(home / fmt::format("summary_r{}.json", k));
      const auto reference = read_json(dir / (method + "_loopback") / fmt::format("summary_r{}.json", k));
      EXPECT_EQ(summary["final_val_loss"].get<double>(), reference["final_val_loss"].get<double>())
          << method << " replica " << k;
      if (method == "noloco") {
        int outer_steps = 0;
        for (const auto& o : metrics_records(home, "outer")) {
          ++outer_steps;
          EXPECT_EQ(o["arrived"], o["group"]) << "replica " << k << " exchanged in every outer step: " << o.dump();
          EXPECT_GT(o["group"].size(), 1u) << o.dump();
        }
        EXPECT_EQ(outer_steps, 4) << "replica " << k;
      }
    }
  }
}
