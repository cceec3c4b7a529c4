// A link: one authenticated, framed and (unless the run is unsealed) sealed
// byte stream between two workers, over a TCP connection that went direct,
// through a punched hole in two NAT routers, or through a relay
// (comm/link/link_endpoint.h says which and how). What crosses between sites
// crosses here; Gloo stays inside a site.
//
// The handshake (link_handshake below) proves both ends hold the run's
// token and names who is at each end; the keys of the two directions come
// out of it, fresh for every link. A message is a run of frames (at most
// kMaxChunk bytes of payload each), so a message of any size streams without
// a sealed copy of it in memory. Sealed frames are libsodium's
// secretstream (XChaCha20-Poly1305): a frame changed, dropped, replayed or
// moved to another link fails to open, and the link is given up.
//
// Both directions work at once: one thread may send while another
// receives. Torch-free: it takes bytes from strangers.
#pragma once
#include <sodium.h>

#include <array>
#include <atomic>
#include <chrono>
#include <functional>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "comm/link/uplink_share.h"

namespace noloco {

using LinkKey = std::array<uint8_t, 32>;
using Clock = std::chrono::steady_clock;

// How a link's connection went.
enum class LinkRoute { direct, punched, relayed };
const char* route_name(LinkRoute route);

// One end of a link: a member `rank` (in its `incarnation`) of the group
// `scope` names ("replicas/stage0", "pipeline").
struct LinkEnd {
  std::string scope;
  int rank = 0;
  int incarnation = 0;
  bool operator==(const LinkEnd& o) const {
    return scope == o.scope && rank == o.rank && incarnation == o.incarnation;
  }
  bool operator<(const LinkEnd& o) const;
  std::string name() const;  // "scope rank.incarnation"
};

class Link {
 public:
  // The largest payload one frame carries; a peer's larger frame breaks the link.
  static constexpr size_t kMaxChunk = size_t(1) << 20;
  // What one message of `size` bytes takes on the wire: its frames' lengths
  // and seals (sealed) or tags (in clear) besides its bytes.
  static constexpr uint64_t wire_bytes(uint64_t size, bool sealed) {
    const uint64_t frames = size == 0 ? 1 : (size + kMaxChunk - 1) / kMaxChunk;
    return size + frames * (4 + (sealed ? crypto_secretstream_xchacha20poly1305_ABYTES : 1));
  }
  // Sealed, each direction's stream starts with a header of this size, once a link.
  static constexpr uint64_t kStreamHeaderBytes = crypto_secretstream_xchacha20poly1305_HEADERBYTES;

  struct Keys {
    std::array<uint8_t, crypto_secretstream_xchacha20poly1305_KEYBYTES> send{}, receive{};
  };
  // Over connected `fd` (owned), whose handshake gave `keys`; in clear unless
  // `sealed`. The streams' headers are the first thing each side sends.
  Link(int fd, LinkRoute route, LinkEnd self, LinkEnd peer, const Keys& keys, bool sealed, const std::string& relay);
  ~Link();
  Link(const Link&) = delete;
  Link& operator=(const Link&) = delete;

  // One message of the parts' bytes, in order. False (and the link broken)
  // when it could not all leave by `deadline`.
  struct Part {
    const uint8_t* data;
    size_t size;
  };
  bool send(const std::vector<Part>& parts, Clock::time_point deadline);
  // Sends share this machine's uplink (comm/link/uplink_share.h) from now on.
  void share_uplink(std::shared_ptr<UplinkShare> uplink) { uplink_ = std::move(uplink); }
  bool shares_uplink() const { return uplink_ != nullptr; }
  // Whether the far end of its connection (the peer, or the relay) is on a local network (comm/link/socket_io.h).
  bool far_end_on_local_network() const;
  // One message into `out` (at most `capacity` bytes): its size, or -1 (the
  // link broken: it closed, timed out, failed to open, or was larger).
  int64_t receive(uint8_t* out, size_t capacity, Clock::time_point deadline);
  // The same into `slots`, filled in order (a message of several tensors).
  struct Slot {
    uint8_t* data;
    size_t size;
  };
  int64_t receive(const std::vector<Slot>& slots, Clock::time_point deadline);
  // Reads the next message past, keeping none of it (one frame's memory at a
  // time): its size, or -1 (the link broken).
  int64_t skip(Clock::time_point deadline);
  // From any thread: every wait on the link ends, and it is broken.
  void shut();
  // Opening: the accepting end tells the dialer it took the link (one byte,
  // before any frame), so that a dialer never holds a link nobody took; the
  // dialer waits for it until `deadline` or `abandon()` (asked every 50 ms).
  bool confirm(Clock::time_point deadline);
  bool await_confirmation(Clock::time_point deadline, const std::function<bool()>& abandon);
  // A failure drill: one byte of the next message's last frame is flipped on the wire.
  void corrupt_next_send() { corrupt_next_ = true; }

  bool broken() const { return broken_; }
  // Whether it broke on a frame that failed authentication (changed on the way, or another key).
  bool unauthentic() const { return unauthentic_; }
  // Why it broke (empty while it works).
  std::string problem() const;
  LinkRoute route() const { return route_; }
  const std::string& relay() const { return relay_; }  // the relay's host:port, when relayed
  const LinkEnd& peer() const { return peer_; }
  // Names this link identically at both ends, and no other link (never 0).
  int64_t id() const { return id_; }
  // What crossed it so far, framing and sealing included.
  uint64_t bytes_sent() const { return bytes_sent_; }
  uint64_t bytes_received() const { return bytes_received_; }

 private:
  struct Received {
    int64_t size;  // -1: broken
    bool last;     // the message's last frame came
  };
  // Frames into `slots` until a message's last (or, with `one_frame`, one frame).
  Received receive_frames(const std::vector<Slot>& slots, Clock::time_point deadline, bool one_frame);
  bool fail(const std::string& why);
  bool write_all(const uint8_t* data, size_t n, Clock::time_point deadline);
  bool read_all(uint8_t* data, size_t n, Clock::time_point deadline);
  bool start_streams(Clock::time_point deadline);

  int fd_;
  LinkRoute route_;
  LinkEnd self_, peer_;
  bool sealed_;
  std::string relay_;
  Keys keys_;
  int64_t id_ = 0;
  crypto_secretstream_xchacha20poly1305_state push_{}, pull_{};
  bool pushing_ = false, pulling_ = false;  // the stream's header sent, received
  std::mutex send_mutex_, receive_mutex_;
  mutable std::mutex problem_mutex_;
  std::string problem_;
  std::atomic<bool> broken_{false}, corrupt_next_{false}, unauthentic_{false};
  std::atomic<uint64_t> bytes_sent_{0}, bytes_received_{0};
  std::vector<uint8_t> frame_, plain_;  // the receive side's buffers
  std::shared_ptr<UplinkShare> uplink_;
};

using LinkPtr = std::shared_ptr<Link>;

// The handshake, on a connection just made (either end may have dialed the
// TCP connection: in a punched hole both did). The `dialer` end speaks first.
//   dialer -> acceptor: Hello (who it is, whom it wants, for which attempt, a fresh nonce, sealed or not)
//   acceptor -> dialer: its nonce and a MAC under `key` of both
//   dialer -> acceptor: its MAC of both
// Each MAC binds the hello and both nonces, so a proof is good for one
// connection only; the direction keys are derived from the same.
namespace link_wire {
constexpr size_t kNonceBytes = 16, kMacBytes = 32, kScopeBytes = 16, kAttemptBytes = 16;
constexpr size_t kHelloBytes = 8 + kScopeBytes + 4 * 4 + kAttemptBytes + kNonceBytes + 4;
constexpr size_t kAnswerBytes = kNonceBytes + kMacBytes;
constexpr size_t kProofBytes = kMacBytes;
}  // namespace link_wire

struct Hello {
  std::array<uint8_t, link_wire::kScopeBytes> scope{};  // a hash of the scope's name
  int dialer_rank = 0, dialer_incarnation = 0, acceptor_rank = 0, acceptor_incarnation = 0;
  // A hash of the attempt's name: a link dialed for one attempt (an
  // evaluation its acceptor gave up) is never taken for another.
  std::array<uint8_t, link_wire::kAttemptBytes> attempt{};
  std::array<uint8_t, link_wire::kNonceBytes> nonce{};
  bool sealed = true;
  std::array<uint8_t, link_wire::kHelloBytes> bytes() const;
  // Empty if `bytes` is no hello (wrong magic).
  static bool parse(const uint8_t* bytes, Hello* out);
};
std::array<uint8_t, link_wire::kScopeBytes> scope_hash(const std::string& scope);
std::array<uint8_t, link_wire::kAttemptBytes> attempt_hash(const std::string& attempt);

// The dialer's half, bounded by `deadline`: a link to `peer` for `attempt`,
// or null with `problem` saying why (the other end is not `peer`, holds
// another token, or did not answer).
LinkPtr dial_handshake(int fd, const LinkKey& key, bool sealed, const LinkEnd& self, const LinkEnd& peer,
                       const std::string& attempt, LinkRoute route, const std::string& relay,
                       Clock::time_point deadline, std::string* problem);

// The acceptor's half, in steps, so that a listener can hold many strangers
// at once on one thread: feed it what arrives, send what it says.
class AcceptHandshake {
 public:
  // `wanted(hello)`: whether this process takes the link a hello asks for
  // (names one of its ends, in the run's sealing).
  AcceptHandshake(const LinkKey& key, std::function<bool(const Hello&)> wanted);
  enum class Step { more, answer, done, refused };
  // Takes bytes as they come; `answer` means answer() must go out now.
  Step feed(const uint8_t* data, size_t n, size_t* used);
  const std::vector<uint8_t>& answer() const { return answer_; }
  const Hello& hello() const { return hello_; }
  // After done: the link's keys (this end's send is the dialer's receive).
  Link::Keys keys() const;
  size_t wants() const;  // bytes it waits for now

 private:
  LinkKey key_;
  std::function<bool(const Hello&)> wanted_;
  std::vector<uint8_t> got_, answer_;
  Hello hello_;
  std::array<uint8_t, link_wire::kNonceBytes> nonce_{};
  bool answered_ = false;
};

}  // namespace noloco
