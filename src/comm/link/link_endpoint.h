// Where a worker's links start and end: one listening port for every link
// dialed to it (all its scopes share it), one punching port whose public
// address the relays tell it, and the relays. opens links to a peer whose
// addresses it is given, in order: direct to the peer's listener; a hole
// punched through both NAT routers (TCP simultaneous open, each end
// connecting from its punching port to the other's public address at the
// same time); through a relay. The route is chosen per pair, automatically.
//
// Why TCP simultaneous open rather than UDP: a link is a byte stream carrying
// megabytes on home uplinks, and over TCP it gets the kernel's congestion
// control, retransmission and flow control for free; a UDP hole would need
// a transport of our own with all of that (iroh's QUIC). Simultaneous open
// works through routers whose mapping is endpoint-independent (the same
// public port for a local port whatever the destination: nftables'
// masquerade keeps it, as most home routers do) and that drop, rather than
// refuse, what they were not asked for; where either router maps each
// connection anew (masquerade random, many carrier-grade NATs) the punch
// fails within its window and the pair goes through a relay.
//
// Strangers at the listening port cost bounded memory: at most kMostStrangers
// held, each for kProofWindow, the oldest closed first.
#pragma once
#include <netinet/in.h>

#include <condition_variable>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "comm/link/link.h"
#include "comm/link/relay.h"

namespace noloco {

// How a peer is reached: what its link book published.
struct LinkAddresses {
  std::string listen;     // ip:port of its listener ("" none)
  std::string reflexive;  // ip:port its punching port is seen at from outside ("" none)
  bool reachable = false; // its listener is reachable from anywhere (advertised): the other end dials
};

struct LinkEndpointOptions {
  std::string bind = "127.0.0.1";
  int port = 0;                // 0: any
  std::string advertise;       // host[:port] published instead of bind:port
  std::vector<std::string> relays;  // host:port, in order of preference
  bool sealed = true;
  // This machine's upload speed, bits a second: links that cross it (punched,
  // relayed, direct to a peer off its local network) pace to it
  // (comm/link/uplink_share.h); 0: none does.
  double uplink = 0;
};

class LinkEndpoint {
 public:
  // Throws std::runtime_error naming the address when it cannot listen.
  LinkEndpoint(const LinkEndpointOptions& options, const LinkKey& link_key, const RelayKey& relay_key);
  ~LinkEndpoint();
  LinkEndpoint(const LinkEndpoint&) = delete;
  LinkEndpoint& operator=(const LinkEndpoint&) = delete;

  // This worker's own addresses, for its peers (the reflexive one asked of
  // the first relay that answers). Each scope served punches from a port of
  // its own (addresses(self) names its reflexive address): a pair's links of
  // two scopes at once (an evaluation's beside an exchange's) would
  // otherwise be the same TCP connection, which only one can be.
  LinkAddresses addresses() const { return addresses_; }
  LinkAddresses addresses(const LinkEnd& self) const;
  int port() const { return port_; }
  bool has_relays() const { return !relays_.empty(); }

  // Links are taken for `end` (one of this process's) from now on; a new
  // scope's punching port is reflected by a relay here.
  void serve(const LinkEnd& end);
  void unserve(const LinkEnd& end);

  // A link from `self` to `peer` at `theirs`; null when none could be made
  // by `deadline` or `abandon()` said to stop (asked every 50 ms), with
  // `problem` saying what each way found. `attempt` tells a pair's repeated
  // opens apart (both ends pass the same): a link is taken only for the
  // attempt it was dialed for.
  LinkPtr open(const LinkEnd& self, const LinkEnd& peer, const LinkAddresses& theirs, const std::string& attempt,
               Clock::time_point deadline, const std::function<bool()>& abandon, std::string* problem);

  static constexpr size_t kMostStrangers = 1024;
  static constexpr auto kProofWindow = std::chrono::seconds(5);
  // How long each way is tried before the next.
  static constexpr auto kDirectWindow = std::chrono::seconds(2);
  static constexpr auto kPunchWindow = std::chrono::seconds(3);

  struct Counts {
    int64_t accepted = 0, refused = 0;
  };
  Counts counts() const;

 private:
  struct Pending;
  void listen_loop();
  void deliver(const AcceptHandshake& handshake, int fd, LinkRoute route, const std::string& relay);
  LinkPtr take(const LinkEnd& self, const LinkEnd& peer, const std::string& attempt);
  bool dials(const LinkEnd& self, const LinkEnd& peer, const LinkAddresses& theirs) const;
  LinkPtr dial(const LinkEnd& self, const LinkEnd& peer, const LinkAddresses& theirs, const std::string& attempt,
               Clock::time_point deadline, const std::function<bool()>& abandon, std::string* problem);
  LinkPtr await(const LinkEnd& self, const LinkEnd& peer, const LinkAddresses& theirs, const std::string& attempt,
                Clock::time_point deadline, const std::function<bool()>& abandon, std::string* problem);
  LinkPtr accept_on(int fd, const LinkEnd& self, const LinkEnd& peer, const std::string& attempt, LinkRoute route,
                    const std::string& relay, Clock::time_point deadline, std::string* problem);
  ListenerId pair_id(const LinkEnd& dialer, const LinkEnd& acceptor, const std::string& attempt) const;
  bool wanted(const Hello& hello) const;

  LinkEndpointOptions options_;
  std::shared_ptr<UplinkShare> uplink_;
  LinkKey key_;
  RelayKey relay_key_;
  std::vector<sockaddr_storage> relays_;
  LinkAddresses addresses_;
  int listen_fd_ = -1, wake_fd_ = -1, port_ = 0;
  struct PunchSlot {
    int port = 0;
    std::string reflexive;  // where a relay saw `port` come from; empty: no punching
  };
  PunchSlot new_punch_slot() const;
  PunchSlot punch_slot(const std::string& scope) const;
  PunchSlot first_punch_;                      // the first scope's; every scope's when none was reflected
  std::map<std::string, PunchSlot> punches_;  // by scope
  std::atomic<bool> stopping_{false};
  mutable std::mutex mutex_;
  std::condition_variable arrived_;
  std::set<LinkEnd> served_;
  struct Dialed {
    LinkPtr link;
    std::array<uint8_t, link_wire::kAttemptBytes> attempt;
  };
  std::map<std::pair<LinkEnd, LinkEnd>, Dialed> inbox_;  // (self, dialer): the newest link dialed
  Counts counts_;
  std::thread thread_;
};

}  // namespace noloco
