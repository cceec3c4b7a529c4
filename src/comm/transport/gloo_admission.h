// Admission in front of the Gloo of LibTorch 1.13 (libgloo.so, 2022): only
// a member of the run gets a Gloo pair's connection.
//
// That Gloo listens on a fresh port for each pair of a new group and takes
// the first connection as the peer. A process that watches the machine's
// socket table (/proc/net/tcp) sees each port the instant it opens, before
// the real peer can learn it from the store, so it would win every pair it
// wants. With admission, the socket Gloo listens on is moved aside: a side
// thread accepts its connections, sends each a fresh 16-byte challenge, and
// hands Gloo only a connection that answers with the MAC (keyed BLAKE2b
// under a key from the run's token) of that challenge and the address it
// connected to (with the listener's id: 8 random bytes in the unused tail of
// the IPv4 address Gloo publishes), and acks it with one byte; strangers are
// closed, and Gloo never waits on them. The member's connect() returns only
// on that ack, so a connection that reached the wrong listener is told apart
// (and, with relays, goes through one: see use_relays below). Gloo's
// own descriptor for the listener becomes an eventfd that the side thread
// signals when a member's connection is ready, so Gloo's event loop wakes
// only then and its accept() returns that connection at once. The member's
// side answers inside Gloo's connect() (called on the thread forming the
// group, never on Gloo's loop).
//
// This works by interposition: the executable defines listen, accept,
// connect, getsockname and close (exported with the linker's dynamic list,
// src/comm/transport/gloo_admission.syms), which act only for calls from libgloo.so on
// a thread inside an Admission scope, or on descriptors such calls created;
// every other call goes straight to the kernel. A LibTorch with Gloo built
// in (2.x: one listener per device, connections named by a sequence number)
// has no libgloo.so: admission is then off and join_gloo_group's greeting
// alone turns strangers away. In a Python process (import noloco) libgloo.so
// binds to libc's calls, not the module's: there admission_available()
// binds libgloo's references to these calls itself (x86-64 and AArch64).
#pragma once
#include <sys/socket.h>

#include <array>
#include <chrono>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "comm/link/relay.h"

namespace noloco {

using AdmissionKey = std::array<uint8_t, 32>;

// How a scope's pair connections went, with relays in use (none counted without).
struct PairRoutes {
  int connections = 0;  // dialed or admitted
  int relayed = 0;      // of which through a relay
  std::string relay;    // the last relay one went through (host:port)
  // Each connection by the id of the pair's listener (ours or the peer's),
  // and whether it went through a relay.
  std::vector<std::pair<ListenerId, bool>> pairs;
  // By group member (join_gloo_group fills it in): whether the pair with it
  // went through a relay. Empty: not known (no relays, or no admission).
  std::vector<bool> relayed_to;

  // The share of connections relayed: a collective's bytes cross them all.
  double relayed_share() const { return connections > 0 ? double(relayed) / double(connections) : 0.0; }
  bool relayed_with(int member) const { return size_t(member) < relayed_to.size() && relayed_to[size_t(member)]; }
};

// While alive, the Gloo pairs this thread creates admit only connections
// that prove `key`, and this thread's pair connects prove it, each waiting
// until `deadline` at most.
class Admission {
 public:
  Admission(const AdmissionKey& key, std::chrono::steady_clock::time_point deadline);
  ~Admission();
  Admission(const Admission&) = delete;
  Admission& operator=(const Admission&) = delete;

  // From any thread: every listener of this scope still waiting for its
  // member gets a connection that is already closed, so Gloo's pair, which
  // waits for it with no way to be interrupted (and in this Gloo up to
  // several times its timeout), fails at once. For an attempt given up.
  void release();

  // The connections this scope's pairs have so far, with relays in use.
  PairRoutes routes() const;

 private:
  const void* outer_;  // the scope this one is inside, if any
  const void* mine_;
};

// The id of the pair's listener that a published Gloo address names: it
// travels in the 8 unused bytes of an IPv4 address (Gloo copies the whole
// address through the store and compares only host and port). Zero otherwise.
ListenerId listener_id(const sockaddr* address);

// This process's Gloo pairs also go through these relays
// (comm/link/relay.h) where a direct connection fails: a listener
// parks at each, a dialer that cannot reach it directly (within 2 s; an
// address that failed so is relayed at once for a minute) asks them in turn.
// None: direct only.
void use_relays(std::vector<sockaddr_storage> relays, const RelayKey& key);

// This process's Gloo listeners are also reached at one fixed port (a port
// forwarded by a home router, a firewall's one opening): a door bound at
// `door` takes every member's connection there and hands it to the listener
// whose admission proof it carries, and every listener publishes
// `advertised` (with its own id) instead of its own address, so that members
// elsewhere dial the door. Advertised port 0: the door's. Returns the door's
// address; throws std::runtime_error naming it when it cannot be bound.
sockaddr_storage listen_at_door(const sockaddr_storage& door, sockaddr_storage advertised);

// Connections the door handed to a listener so far.
uint64_t door_admitted();

// Whether use_relays named any: a pair's connection may then close because
// its relay went, not its peer.
bool relays_in_use();

// How many times a relay in use was lost. Each is watched through an idle
// park of this process's own, which its death ends at once (or, where the
// reset is lost on the way, within the idle probes: about 5 s); it is parked
// again every 2 s. A Gloo pair through a lost relay may never learn it (Gloo
// 1.13 can lose the connection's events and wait out its whole timeout), so
// a group formed before the count changed is not trusted after it.
uint64_t relays_lost();

// Connects to `address`, proves `key` when given (else just connects), and
// closes: a Gloo pair waiting there for its peer stops waiting. Bounded by
// one second.
void knock(const sockaddr_storage& address, const AdmissionKey* key);

// Whether this process's Gloo is the one admission works with (libgloo.so)
// and its calls come to admission: exported by the executable, or, the first
// time this is asked in a process that does not export them, libgloo.so's
// references bound to them here.
bool admission_available();

}  // namespace noloco
