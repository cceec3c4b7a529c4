// The run's store on etcd: TCPStore's semantics through the adapter, only
// the run's token gets in, it listens where told, and a stranger's slow or
// malformed connection neither stalls nor bloats a run.
#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <poll.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <future>
#include <thread>

#include <fmt/format.h>

#include "comm/store/etcd_server.h"
#include "comm/store/etcd_store.h"
#include "comm/store/store.h"
#include "etcd_cluster.h"
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

// A member that dies just after it committed a request, before its answer
// left: a proxy in front of an etcd that passes everything on, except that
// the answer to the first transaction it carries is dropped with the
// connection (once etcd has started answering, so the transaction went through).
class AnswerLostOnce {
 public:
  explicit AnswerLostOnce(int upstream_port) : upstream_(upstream_port) {
    listener_ = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in at{};
    at.sin_family = AF_INET;
    at.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t length = sizeof(at);
    ::bind(listener_, reinterpret_cast<sockaddr*>(&at), sizeof(at));
    ::listen(listener_, 16);
    ::getsockname(listener_, reinterpret_cast<sockaddr*>(&at), &length);
    port_ = ntohs(at.sin_port);
    accepting_ = std::thread([this] {
      for (int client; (client = ::accept(listener_, nullptr, nullptr)) >= 0;)
        carriers_.emplace_back([this, client] { carry(client); });
    });
  }
  ~AnswerLostOnce() {
    ::shutdown(listener_, SHUT_RDWR);
    ::close(listener_);
    accepting_.join();
    for (auto& c : carriers_) c.join();
  }
  int port() const { return port_; }
  bool dropped() const { return dropped_; }

 private:
  void carry(int client) {
    const int upstream = connect_to("127.0.0.1", upstream_);
    std::string request;  // client bytes not yet forwarded whole
    char buffer[65536];
    bool open = upstream >= 0;
    while (open) {
      pollfd both[2] = {{client, POLLIN, 0}, {upstream, POLLIN, 0}};
      if (::poll(both, 2, 10000) <= 0) break;
      if (both[1].revents) {
        const auto n = ::recv(upstream, buffer, sizeof(buffer), 0);
        open = n > 0 && ::send(client, buffer, size_t(n), MSG_NOSIGNAL) == n;
      }
      if (open && both[0].revents) {
        const auto n = ::recv(client, buffer, sizeof(buffer), 0);
        open = n > 0;
        if (open) request.append(buffer, size_t(n));
        // Whole requests only (curl always sends a Content-Length).
        for (size_t end; open && (end = request.find("\r\n\r\n")) != std::string::npos;) {
          const auto length_at = request.find("Content-Length: ");
          const size_t body = length_at < end ? std::stoul(request.substr(length_at + 16)) : 0;
          if (request.size() < end + 4 + body) break;
          const auto whole = request.substr(0, end + 4 + body);
          request.erase(0, whole.size());
          open = ::send(upstream, whole.data(), whole.size(), MSG_NOSIGNAL) == ssize_t(whole.size());
          if (open && whole.rfind("POST /v3/kv/txn", 0) == 0 && !dropped_.exchange(true)) {
            pollfd answer{upstream, POLLIN, 0};
            ::poll(&answer, 1, 10000);
            open = false;  // committed and answered: the answer is lost with the connection
          }
        }
      }
    }
    ::close(client);
    if (upstream >= 0) ::close(upstream);
  }

  int upstream_, listener_ = -1, port_ = 0;
  std::atomic<bool> dropped_{false};
  std::thread accepting_;
  std::vector<std::thread> carriers_;
};

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
  // A key holding the empty value matches an empty `expected`, as in TCPStore.
  store.set("emptied", {});
  EXPECT_EQ(text(store.compareSet("emptied", {}, bytes("again"))), "again");
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

// Issue 32: a rejoin emptied the list of dead workers, and the next death
// declared spun the launcher on the store forever.
TEST(EtcdStore, AListEmptiedAndAppendedAgainHoldsTheNewItem) {
  SKIP_WITHOUT_ETCD();
  EtcdServer server("127.0.0.1", 0, "secret");
  EtcdStore store(server.endpoint(), "root", "secret", std::chrono::milliseconds(3000));
  append_item(store, "dead", "1");
  remove_item(store, "dead", "1");
  EXPECT_EQ(read_or_empty(store, "dead"), "");
  EXPECT_TRUE(store.check({"dead"}));  // emptied, not deleted
  append_item(store, "dead", "2");
  EXPECT_EQ(read_or_empty(store, "dead"), "2,");
}

TEST(EtcdStore, OnlyTheRunTokenGetsIn) {
  SKIP_WITHOUT_ETCD();
  EtcdServer server("127.0.0.1", 0, "the-token");
  try {
    EtcdStore stranger(server.endpoint(), "root", "guess", std::chrono::milliseconds(2000));
    FAIL() << "a wrong password was accepted";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("could not join the run's store"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("wrong NOLOCO_RUN_TOKEN?"), std::string::npos) << e.what();
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

// Issue 12's probe, on the store a run without a launcher has (worker 0
// hosts an etcd on bind:MASTER_PORT; it used to be c10d's TCPStore, which
// listened on every interface and froze under this probe): a stranger
// connects to the store's port and sends one byte, or a length of 2^30, and
// holds the connection. The run goes on, and the port is not open elsewhere.
TEST(EtcdServer, AStrangersHeldConnectionsDoNotStallARun) {
  SKIP_WITHOUT_ETCD();
  TempDir dir;
  noloco::testing::write_text(dir / "c.txt", noloco::testing::shakespeare(20000));
  const int port = noloco::testing::free_port();
  const std::string run = dir / "run";
  noloco::testing::CliResult results[2];
  std::vector<std::thread> workers;
  for (int rank = 0; rank < 2; ++rank)
    workers.emplace_back([&, rank] {
      results[rank] = noloco::testing::run_cli(
          noloco::testing::small_train_args(dir / "c.txt", run) +
              " method=noloco replicas=2 batch=2 steps=100000 outer_interval=5 peer_timeout=10",
          90,
          fmt::format("RANK={} WORLD_SIZE=2 LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT={} "
                      "NOLOCO_RUN_TOKEN=strangers-test",
                      rank, port));
    });
  auto lines = [&] {
    const auto t = noloco::testing::read_text(run + "/metrics.jsonl");
    return std::count(t.begin(), t.end(), '\n');
  };
  for (int i = 0; i < 600 && lines() < 20; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  const auto elsewhere = other_address();
  const int there = elsewhere.empty() ? -1 : connect_to(elsewhere, port);
  const int one_byte = connect_to("127.0.0.1", port), huge = connect_to("127.0.0.1", port);
  bool sent = one_byte >= 0 && huge >= 0 && ::send(one_byte, "\x02", 1, 0) == 1;
  const char length[9] = {0, 0, 0, 0, 0x40, 0, 0, 0, 0};  // \x00 then 2^30, little-endian
  sent = sent && ::send(huge, length, 9, 0) == 9;
  const auto before = lines();
  std::this_thread::sleep_for(std::chrono::seconds(12));  // longer than peer_timeout: TCPStore would have failed the run
  const auto after = lines();
  for (int fd : {one_byte, huge, there})
    if (fd >= 0) ::close(fd);
  EXPECT_EQ(::system(("pkill -INT -f '[n]oloco train .*out=" + run + " '").c_str()), 0);
  for (auto& w : workers) w.join();
  ASSERT_TRUE(sent) << results[0].output;
  EXPECT_LT(there, 0) << "worker 0's store answered on " << elsewhere << " (bind is 127.0.0.1)";
  EXPECT_GT(after, before + 20) << "training stalled while a stranger held the store";
  for (const auto& r : results) {
    EXPECT_EQ(r.output.find("Socket Timeout"), std::string::npos) << r.output;
    EXPECT_NE(r.exit_code, 124) << r.output;
  }
}

// Issue 33: the store used to listen before authentication was on, and a
// local process that read its port from etcd's command line got in first,
// made a root user of its own and read the run token. Now a store on a TCP
// port opens it only once authentication is on: a stranger hammering the
// port while the store starts never gets a request through.
TEST(EtcdServer, NobodyGetsInBeforeAuthenticationIsOn) {
  SKIP_WITHOUT_ETCD();
  const int port = noloco::testing::free_port();
  std::atomic<bool> up{false};
  std::atomic<int> accepted{0};
  std::string last_refusal;
  std::thread stranger([&] {
    // No time-based loop: it tries until the store is up, then once more.
    for (bool last = false; !last;) {
      last = up.load();
      EtcdStore anonymous(fmt::format("http://127.0.0.1:{}", port), "", "", std::chrono::milliseconds(500));
      try {
        anonymous.request("/v3/auth/user/add", R"({"name":"root","password":"stolen"})");
        ++accepted;
      } catch (const std::runtime_error&) {
      }
      try {
        anonymous.set("planted", bytes("x"));
        ++accepted;
      } catch (const std::runtime_error& e) {
        last_refusal = e.what();
      }
      if (!last) std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
  });
  {
    EtcdServer server("127.0.0.1", port, "the-token");
    up = true;
    stranger.join();
    EXPECT_THROW(EtcdStore(server.endpoint(), "root", "stolen", std::chrono::milliseconds(2000)), std::runtime_error);
    EtcdStore owner(server.endpoint(), "root", "the-token", std::chrono::milliseconds(2000));
    EXPECT_FALSE(owner.check({"planted"}));
  }
  EXPECT_EQ(accepted.load(), 0);
  // The last try reached the store, which refused it (not a closed port).
  EXPECT_EQ(last_refusal.find("connect"), std::string::npos) << last_refusal;
  EXPECT_FALSE(last_refusal.empty());
}

// The launcher's store is a unix socket in a directory only its owner can
// enter: another local user cannot even connect to it (a stranger's held or
// bloating requests, and any race with its set-up, need a connection).
TEST(EtcdServer, TheLaunchersStoreIsReachableOnlyByItsUser) {
  SKIP_WITHOUT_ETCD();
  if (::geteuid() != 0) GTEST_SKIP() << "skipped: needs root to try as another user";
  EtcdServer server("the-token");
  ASSERT_EQ(server.endpoint().rfind("unix://", 0), 0u) << server.endpoint();
  EXPECT_EQ(server.port(), 0);
  const std::string path = server.endpoint().substr(7);
  EtcdStore owner(server.endpoint(), "root", "the-token", std::chrono::milliseconds(2000));
  owner.set("k", bytes("v"));
  const pid_t child = ::fork();
  if (child == 0) {
    if (::setgid(65534) != 0 || ::setuid(65534) != 0) ::_exit(2);
    const int fd = ::socket(AF_UNIX, SOCK_STREAM, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::snprintf(addr.sun_path, sizeof addr.sun_path, "%s", path.c_str());
    const bool refused = ::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 && errno == EACCES;
    ::_exit(refused ? 0 : 1);
  }
  int status = 0;
  ::waitpid(child, &status, 0);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << "user nobody could connect to " << path;
}

// A store other machines reach (worker 0 hosting it) speaks TLS only, with
// the key the run's token gives: a client pins that key (no authority vouches
// for it) and presents the certificate the token gives, or the handshake
// fails before any request reaches etcd: without the pin, with another run's,
// without the certificate (a stranger who found the port), with another
// run's, or in plain HTTP, nothing.
TEST(EtcdServer, AStoreOnAPortSpeaksTlsWithTheKeyTheTokenGivesToTokenHoldersOnly) {
  SKIP_WITHOUT_ETCD();
  const auto tls = store_tls_key("the-token");
  EtcdServer server("127.0.0.1", 0, "secret", &tls);
  ASSERT_EQ(server.endpoint().rfind("https://127.0.0.1:", 0), 0u) << server.endpoint();
  const std::chrono::milliseconds wait(3000);
  EtcdStore holder(server.endpoint(), "root", "secret", wait, tls);
  holder.set("k", bytes("v"));
  EXPECT_EQ(text(holder.get("k")), "v");
  StoreTlsKey stranger = tls;
  stranger.certificate_pem.clear();  // knows the pin (it is public), has no certificate
  const auto other = store_tls_key("another-token");
  StoreTlsKey other_client = tls;  // pins the right key, presents another run's certificate
  other_client.certificate_pem = other.certificate_pem;
  other_client.private_key_pem = other.private_key_pem;
  // The store asks for no user past the handshake (on TLS the certificate is the credential), so a
  // refused write is the handshake's doing.
  const auto write_as = [&](const std::string& endpoint, const StoreTlsKey& client) {
    EtcdStore store(endpoint, "", "", wait, client);
    store.set("k", bytes("overwritten"));
  };
  for (const auto& refused : {StoreTlsKey{}, stranger, other, other_client})
    EXPECT_THROW(write_as(server.endpoint(), refused), std::runtime_error);
  EXPECT_THROW(write_as("http://127.0.0.1:" + std::to_string(server.port()), {}), std::runtime_error);
  EXPECT_EQ(text(holder.get("k")), "v");
}

// What the store sees of a run (key prefix, password, TLS key) is derived
// from the token, stable, different per token and per purpose, and never the token.
TEST(RunKeys, StoreSecretsAreDerivedStableAndNeverTheToken) {
  const std::string token = "0123456789abcdef0123456789abcdef";
  EXPECT_EQ(store_password(token), store_password(token));
  EXPECT_EQ(store_tls_key(token).pin, store_tls_key(token).pin);
  EXPECT_NE(store_password(token), store_key_prefix(token));
  EXPECT_NE(store_password(token), store_password(token + "0"));
  EXPECT_NE(store_tls_key(token).pin, store_tls_key(token + "0").pin);
  for (const auto& shown : {store_password(token), store_key_prefix(token), store_tls_key(token).pin})
    EXPECT_EQ(shown.find(token.substr(0, 8)), std::string::npos) << shown;
  EXPECT_EQ(store_tls_key(token).private_key_pem.rfind("-----BEGIN PRIVATE KEY-----\n", 0), 0u);
  EXPECT_EQ(store_tls_key(token).pin.rfind("sha256//", 0), 0u);
  // Every worker makes the same certificate bytes (no copy from the host needed).
  EXPECT_EQ(store_tls_key(token).certificate_pem, store_tls_key(token).certificate_pem);
  EXPECT_NE(store_tls_key(token).certificate_pem, store_tls_key(token + "0").certificate_pem);
  EXPECT_EQ(store_tls_key(token).certificate_pem.rfind("-----BEGIN CERTIFICATE-----\n", 0), 0u);
}

// Issue 29: a store that is an etcd cluster (NOLOCO_STORE lists its members)
// outlives any one member: a connection whose member dies goes on at the
// next, its waits included.
// An add whose answer was lost (its member died just after committing it) is
// asked again at the next member: it counts once. It counted twice before: a
// NoLoCo arrival counter at 2 reads "given up", and a cluster run's two
// replicas went alone for an outer step, or each waited for the other at
// another exchange until killed.
TEST(EtcdStore, AnAddWhoseAnswerWasLostCountsOnce) {
  SKIP_WITHOUT_ETCD();
  EtcdServer server("127.0.0.1", 0, "secret");
  AnswerLostOnce dying(server.port());
  const std::chrono::milliseconds wait(5000);
  EtcdStore store(fmt::format("http://127.0.0.1:{},{}", dying.port(), server.endpoint()), "root", "secret", wait);
  EXPECT_EQ(store.add("arrived", 1), 1);
  EXPECT_TRUE(dying.dropped()) << "the proxy carried no transaction";
  EtcdStore reader(server.endpoint(), "root", "secret", wait);
  EXPECT_EQ(text(reader.get("arrived")), "1");
  EXPECT_EQ(store.add("arrived", 2), 3) << "later adds count as before";
  EXPECT_EQ(reader.add("arrived", 0), 3);
}

TEST(EtcdStore, AClusterMemberDyingHandsOverToTheNext) {
  SKIP_WITHOUT_ETCD();
  noloco::testing::EtcdCluster cluster(3, "secret");
  const std::chrono::milliseconds wait(5000);
  EtcdStore store(cluster.endpoints(), "root", "secret", wait);
  store.set("a", bytes("1"));
  EXPECT_EQ(store.add("n", 2), 2);
  std::string later;
  std::thread waiter([&] { later = text(store.get("later")); });  // watching at member 0
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  cluster.kill(0);
  EtcdStore writer(cluster.endpoint(1) + "," + cluster.endpoint(2), "root", "secret", wait);
  writer.set("later", bytes("here"));
  waiter.join();
  EXPECT_EQ(later, "here");
  EXPECT_EQ(text(store.get("a")), "1");
  EXPECT_EQ(store.add("n", 3), 5);
  EXPECT_EQ(text(store.compareSet("c", {}, bytes("x"))), "x");
  cluster.kill(1);  // no quorum left: a clear error, not a hang
  EXPECT_THROW(store.set("b", bytes("2")), std::runtime_error);
  // Issue 50 item 8: a login that fails for want of quorum does not blame the token.
  try {
    EtcdStore late(cluster.endpoint(2), "root", "secret", std::chrono::milliseconds(3000));
    FAIL() << "logged in without quorum";
  } catch (const std::runtime_error& e) {
    EXPECT_EQ(std::string(e.what()).find("wrong NOLOCO_RUN_TOKEN"), std::string::npos) << e.what();
  }
}

// Issue 50 item 4: a SIGSTOPped member (the one in use) froze every worker
// for as long as it was stopped: a request waited the whole timeout for it,
// then once more. Now a member that does not answer within seconds is taken
// for hung and the next one is asked; the stopped one comes back unharmed.
TEST(EtcdStore, AHungClusterMemberCostsSecondsNotTheTimeout) {
  SKIP_WITHOUT_ETCD();
  noloco::testing::EtcdCluster cluster(3, "secret");
  EtcdStore store(cluster.endpoints(), "root", "secret", std::chrono::milliseconds(60000));
  store.set("a", bytes("1"));
  cluster.stop(0);
  const auto start = std::chrono::steady_clock::now();
  store.set("b", bytes("2"));
  EXPECT_EQ(text(store.get("a")), "1");
  EXPECT_EQ(store.add("n", 1), 1);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  cluster.resume(0);
  EXPECT_LT(seconds, 15.0) << "a hung member cost the request's whole timeout";
  EtcdStore at_first(cluster.endpoint(0), "root", "secret", std::chrono::milliseconds(10000));
  EXPECT_EQ(text(at_first.get("b")), "2");
}

// A wait is a watch, quiet until its key is put: one waiting at a member that
// hangs moves to the next member and sees the key put there, instead of
// waiting as long as the member is stopped.
TEST(EtcdStore, AWaitAtAHungClusterMemberSeesTheKeyPutElsewhere) {
  SKIP_WITHOUT_ETCD();
  noloco::testing::EtcdCluster cluster(3, "secret");
  EtcdStore waiter(cluster.endpoints(), "root", "secret", std::chrono::milliseconds(60000));
  waiter.set("ready", bytes("1"));  // logged in at member 0, where its watch will wait
  auto waited = std::async(std::launch::async, [&] { waiter.wait({"late"}); });
  EXPECT_EQ(waited.wait_for(std::chrono::milliseconds(500)), std::future_status::timeout);
  cluster.stop(0);
  EtcdStore writer(cluster.endpoint(1), "root", "secret", std::chrono::milliseconds(30000));
  writer.set("late", bytes("2"));
  const auto start = std::chrono::steady_clock::now();
  const auto status = waited.wait_for(std::chrono::seconds(20));
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  cluster.resume(0);
  waited.get();
  EXPECT_EQ(status, std::future_status::ready) << "the wait stayed with the stopped member";
  EXPECT_LT(seconds, 10.0);
}
