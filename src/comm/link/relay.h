// A relay for workers that can only connect out (behind NAT routers and
// firewalls, issue 66): both ends of a pair connect out to it, and it
// splices the two connections into one byte stream, each direction on its
// own thread so that both carry at once. Links (comm/link/link_endpoint.h)
// and, for what still runs on Gloo, Gloo's pairs run over the spliced stream
// as over a direct connection.
//
// The listening end of a pair parks a connection at the relay under the
// pair's id (8 bytes: for a link, a MAC of its two ends; for a Gloo pair,
// the listener id inside the address Gloo publishes,
// comm/transport/gloo_admission.h); the dialing end asks for that id, and
// the relay joins the two. It also tells a connection the address it sees
// it come from (kReflect), which is what a hole punch aims at. Only holders
// of the run's token use it: each connection answers a fresh challenge with
// a MAC under a key from the token before the relay does anything for it.
// The relay never reads what it carries: the link's handshake runs end to
// end through the splice, and every payload is sealed, so it can neither
// read nor forge a message; the worst it can do is drop the connection,
// which the ends see as a broken link.
#pragma once
#include <sys/socket.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace noloco {

using RelayKey = std::array<uint8_t, 32>;
using ListenerId = std::array<uint8_t, 8>;

namespace relay_wire {
constexpr size_t kChallengeBytes = 16;
constexpr size_t kProofBytes = 32;
constexpr uint8_t kPark = 'P';    // a listener's connection, waiting for its dialer
constexpr uint8_t kDial = 'D';    // a dialer's, asking for a listener
constexpr uint8_t kJoined = 'J';  // sent to both once spliced
// Asks where the relay sees the connection come from; the answer is
// kAddressBytes (IPv4 address and port, network order; zeros: not IPv4) and
// their reflection_proof, then the relay closes. A worker behind NAT learns
// the public address its router gives its connections, which a hole punch
// aims at.
constexpr uint8_t kReflect = 'W';
constexpr size_t kAddressBytes = 6;
constexpr size_t kReflectionBytes = kAddressBytes + kProofBytes;
constexpr size_t kRequestBytes = 1 + sizeof(ListenerId) + kProofBytes;
// The MAC a client sends after the relay's challenge: it binds the request
// (park or dial, which listener) to this connection's challenge.
std::array<uint8_t, kProofBytes> request_proof(const RelayKey& key, uint8_t op, const ListenerId& id,
                                               const uint8_t* challenge);
// The relay's MAC over the address it reflects and the connection's
// challenge. Without it, whoever is on the path could rewrite the address
// and so aim every punch of the run's workers at a third party.
std::array<uint8_t, kProofBytes> reflection_proof(const RelayKey& key, const uint8_t* address,
                                                  const uint8_t* challenge);
}  // namespace relay_wire

// "host:port[,host:port...]" (NOLOCO_RELAY) resolved to IPv4 addresses;
// throws std::invalid_argument naming an entry that is not one.
std::vector<sockaddr_storage> resolve_relays(const std::string& list);

// The client's half: a connection to `relay` that has proved `key` and made
// its request (`op` for listener `id`), or -1 with errno set when it could
// not by `deadline`. The caller then waits for relay_wire::kJoined.
int relay_request(const sockaddr_storage& relay, const RelayKey& key, uint8_t op, const ListenerId& id,
                  std::chrono::steady_clock::time_point deadline);

struct RelayStats {
  int64_t spliced = 0;   // pairs joined
  int64_t refused = 0;   // connections that did not prove the key in time
  int64_t bytes = 0;     // carried, both directions
  int64_t live = 0;      // splices open now
  int64_t parked = 0;    // listeners (and workers watching it) waiting now
  int64_t reflected = 0; // addresses told back to their connections
};

class RelayServer {
 public:
  // Listens on `bind`:`port` (0: a free port). Throws std::runtime_error
  // naming the address when it cannot.
  RelayServer(const std::string& bind, int port, const RelayKey& key);
  ~RelayServer();
  RelayServer(const RelayServer&) = delete;
  RelayServer& operator=(const RelayServer&) = delete;

  int port() const { return port_; }
  RelayStats stats() const;

  // Strangers (connections that have not proved the key) held at once: the
  // oldest go first, so a flood costs bounded memory and never blocks a
  // member. At most half the process's descriptors, so that the run's own
  // connections always have the other half.
  static constexpr size_t kMostStrangers = 4096;
  // How long a connection has to prove the key, and a dialer waits for its listener to park.
  static constexpr auto kProofWindow = std::chrono::seconds(5);
  static constexpr auto kParkWait = std::chrono::seconds(10);

 private:
  struct Connection;
  struct Carried;
  void serve();
  void accept_all();
  // Closes the connection that has waited longest to prove the key; false if none does.
  bool drop_oldest_stranger();
  void read_request(Connection& c);
  void splice(Connection& listener, Connection& dialer);
  void reflect(Connection& c);
  void close_connection(Connection& c);

  const RelayKey key_;
  int listen_fd_ = -1, wake_fd_ = -1, port_ = 0;
  size_t most_strangers_ = kMostStrangers;
  // Out of descriptors with no stranger to drop: the listener rests until then.
  std::chrono::steady_clock::time_point accept_paused_until_{};
  std::atomic<bool> stopping_{false};
  std::vector<std::unique_ptr<Connection>> connections_;  // serve()'s own
  std::map<ListenerId, Connection*> parked_;
  std::shared_ptr<Carried> carried_;
  std::atomic<int64_t> refused_{0}, spliced_{0}, parked_now_{0}, reflected_{0};
  std::thread thread_;
};

}  // namespace noloco
