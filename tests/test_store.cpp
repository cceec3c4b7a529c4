// The run's store on etcd: TCPStore's semantics through the adapter, only
// the run's token gets in, it listens where told, and a stranger's slow or
// malformed connection neither stalls nor bloats a run.
#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <thread>

#include <fmt/format.h>

#include "comm/etcd_server.h"
#include "comm/etcd_store.h"
#include "test_util.h"

using namespace noloco;
using noloco::testing::TempDir;

namespace {

std::vector<uint8_t> bytes(const std::string& s) { return {s.begin(), s.end()}; }
std::string text(const std::vector<uint8_t>& v) { return {v.begin(), v.end()}; }

#define SKIP_WITHOUT_ETCD() \
  if (EtcdServer::binary().empty()) GTEST_SKIP() << "skipped: no etcd binary (install etcd-server)"

// Opens a TCP connection to host:port; -1 if refused.
int connect_to(const std::string& host, int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(uint16_t(port));
  ::inet_pton(AF_INET, host.c_str(), &addr.sin_addr);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

// An IPv4 address of this machine other than loopback, or "".
std::string other_address() {
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) != 0) return "";
  std::string found;
  for (auto* a = list; a && found.empty(); a = a->ifa_next) {
    if (!a->ifa_addr || a->ifa_addr->sa_family != AF_INET) continue;
    char buf[INET_ADDRSTRLEN];
    ::inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(a->ifa_addr)->sin_addr, buf, sizeof buf);
    if (std::string(buf).rfind("127.", 0) != 0) found = buf;
  }
  ::freeifaddrs(list);
  return found;
}

}  // namespace

TEST(EtcdStore, KeepsTheSemanticsOfTCPStore) {
  SKIP_WITHOUT_ETCD();
  EtcdServer server("127.0.0.1", 0, "secret");
  EtcdStore store(server.endpoint(), "root", "secret", std::chrono::milliseconds(3000));
  store.set("a", bytes("1"));
  EXPECT_EQ(text(store.get("a")), "1");
  EXPECT_EQ(store.add("n", 2), 2);
  EXPECT_EQ(store.add("n", 3), 5);
  EXPECT_EQ(text(store.get("n")), "5");  // a decimal counter, as TCPStore keeps it
  // compareSet: writes over `expected`, or creates when absent and `expected` is empty; returns what stays.
  EXPECT_EQ(text(store.compareSet("c", {}, bytes("first"))), "first");
  EXPECT_EQ(text(store.compareSet("c", {}, bytes("second"))), "first");
  EXPECT_EQ(text(store.compareSet("c", bytes("first"), bytes("third"))), "third");
  EXPECT_EQ(text(store.compareSet("absent", bytes("x"), bytes("y"))), "x");
  EXPECT_TRUE(store.check({"a", "n", "c"}));
  EXPECT_FALSE(store.check({"a", "nope"}));
  EXPECT_EQ(store.getNumKeys(), 3);
  EXPECT_TRUE(store.deleteKey("a"));
  EXPECT_FALSE(store.deleteKey("a"));
  // get and wait block until another connection writes the key, and time out otherwise.
  std::thread writer([&] {
    EtcdStore other(server.endpoint(), "root", "secret", std::chrono::milliseconds(3000));
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    other.set("later", bytes("here"));
  });
  EXPECT_EQ(text(store.get("later")), "here");
  writer.join();
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_THROW(store.wait({"never"}, std::chrono::milliseconds(300)), std::runtime_error);
  EXPECT_GE(std::chrono::steady_clock::now() - t0, std::chrono::milliseconds(300));
}

TEST(EtcdStore, OnlyTheRunTokenGetsIn) {
  SKIP_WITHOUT_ETCD();
  EtcdServer server("127.0.0.1", 0, "the-token");
  try {
    EtcdStore stranger(server.endpoint(), "root", "guess", std::chrono::milliseconds(2000));
    FAIL() << "a wrong password was accepted";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("could not join the run's store"), std::string::npos) << e.what();
  }
  EtcdStore anonymous(server.endpoint(), "", "", std::chrono::milliseconds(2000));
  EXPECT_THROW(anonymous.set("k", bytes("v")), std::runtime_error);  // nothing without a login
}

TEST(EtcdServer, ListensOnlyWhereItIsTold) {
  SKIP_WITHOUT_ETCD();
  const auto elsewhere = other_address();
  if (elsewhere.empty()) GTEST_SKIP() << "skipped: this machine has no address besides loopback";
  EtcdServer server("127.0.0.1", 0, "t");
  const int here = connect_to("127.0.0.1", server.port());
  EXPECT_GE(here, 0);
  if (here >= 0) ::close(here);
  const int there = connect_to(elsewhere, server.port());
  EXPECT_LT(there, 0) << "the store answered on " << elsewhere;
  if (there >= 0) ::close(there);
  try {
    EtcdServer nowhere("8.8.8.8", 0, "t");
    FAIL() << "started on an address that is not this machine's";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("8.8.8.8"), std::string::npos) << e.what();
  }
}

// Issue 12's probe: a stranger connects to the store's port and sends one
// byte, or a length of 2^30, and holds the connection. The run goes on.
TEST(EtcdServer, AStrangersHeldConnectionsDoNotStallARun) {
  SKIP_WITHOUT_ETCD();
  TempDir dir;
  noloco::testing::write_text(dir / "c.txt", noloco::testing::shakespeare(20000));
  const int port = noloco::testing::free_port();
  const std::string run = dir / "run";
  noloco::testing::CliResult result;
  std::thread runner([&] {
    result = noloco::testing::run_cli(noloco::testing::small_train_args(dir / "c.txt", run) +
                                          fmt::format(" method=noloco replicas=2 batch=2 steps=100000 outer_interval=5 "
                                                      "port={} peer_timeout=10",
                                                      port),
                                      90);
  });
  auto lines = [&] {
    const auto t = noloco::testing::read_text(run + "/metrics.jsonl");
    return std::count(t.begin(), t.end(), '\n');
  };
  for (int i = 0; i < 300 && lines() < 20; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  const int one_byte = connect_to("127.0.0.1", port), huge = connect_to("127.0.0.1", port);
  ASSERT_GE(one_byte, 0);
  ASSERT_GE(huge, 0);
  ASSERT_EQ(::send(one_byte, "\x02", 1, 0), 1);
  const char length[9] = {0, 0, 0, 0, 0x40, 0, 0, 0, 0};  // \x00 then 2^30, little-endian
  ASSERT_EQ(::send(huge, length, 9, 0), 9);
  const auto before = lines();
  std::this_thread::sleep_for(std::chrono::seconds(12));  // longer than peer_timeout: TCPStore would have failed the run
  const auto after = lines();
  ::close(one_byte);
  ::close(huge);
  EXPECT_GT(after, before + 20) << "training stalled while a stranger held the store";
  EXPECT_EQ(::system(("pkill -INT -f '[n]oloco train .*out=" + run + " '").c_str()), 0);
  runner.join();
  EXPECT_EQ(result.output.find("Socket Timeout"), std::string::npos) << result.output;
  EXPECT_EQ(result.output.find("exited with code"), std::string::npos) << result.output;
}
