#include "comm/link/link.h"

#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <tuple>

#include <fmt/format.h>

#include "comm/link/socket_io.h"

namespace noloco {

namespace {

constexpr std::array<uint8_t, 8> kMagic{'n', 'o', 'l', 'o', 'c', 'o', 'L', '1'};
constexpr size_t kStreamHeader = crypto_secretstream_xchacha20poly1305_HEADERBYTES;
constexpr size_t kSealOverhead = crypto_secretstream_xchacha20poly1305_ABYTES;

void put_u32(uint8_t* out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out[i] = uint8_t(v >> (8 * i));
}

uint32_t get_u32(const uint8_t* in) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= uint32_t(in[i]) << (8 * i);
  return v;
}

// A MAC (keyed BLAKE2b) of `label`, the hello and the acceptor's nonce.
std::array<uint8_t, 32> bound(const LinkKey& key, const char* label, const std::array<uint8_t, link_wire::kHelloBytes>& hello,
                              const uint8_t* nonce) {
  crypto_generichash_state state;
  crypto_generichash_init(&state, key.data(), key.size(), 32);
  crypto_generichash_update(&state, reinterpret_cast<const uint8_t*>(label), std::strlen(label));
  crypto_generichash_update(&state, hello.data(), hello.size());
  crypto_generichash_update(&state, nonce, link_wire::kNonceBytes);
  std::array<uint8_t, 32> out{};
  crypto_generichash_final(&state, out.data(), out.size());
  return out;
}

Link::Keys keys_of(const LinkKey& key, const std::array<uint8_t, link_wire::kHelloBytes>& hello, const uint8_t* nonce,
                   bool dialer) {
  Link::Keys keys;
  const auto to_acceptor = bound(key, "noloco link key dialer->acceptor", hello, nonce);
  const auto to_dialer = bound(key, "noloco link key acceptor->dialer", hello, nonce);
  std::copy(to_acceptor.begin(), to_acceptor.end(), (dialer ? keys.send : keys.receive).begin());
  std::copy(to_dialer.begin(), to_dialer.end(), (dialer ? keys.receive : keys.send).begin());
  return keys;
}

}  // namespace

const char* route_name(LinkRoute route) {
  switch (route) {
    case LinkRoute::direct: return "direct";
    case LinkRoute::punched: return "punched";
    case LinkRoute::relayed: return "relayed";
  }
  return "?";
}

bool LinkEnd::operator<(const LinkEnd& o) const {
  return std::tie(scope, rank, incarnation) < std::tie(o.scope, o.rank, o.incarnation);
}

std::string LinkEnd::name() const { return fmt::format("{} {}.{}", scope, rank, incarnation); }

std::array<uint8_t, link_wire::kScopeBytes> scope_hash(const std::string& scope) {
  std::array<uint8_t, link_wire::kScopeBytes> out{};
  crypto_generichash(out.data(), out.size(), reinterpret_cast<const uint8_t*>(scope.data()), scope.size(), nullptr, 0);
  return out;
}

std::array<uint8_t, link_wire::kAttemptBytes> attempt_hash(const std::string& attempt) {
  static_assert(link_wire::kAttemptBytes == link_wire::kScopeBytes, "an attempt's name is hashed as a scope's");
  return scope_hash(attempt);
}

std::array<uint8_t, link_wire::kHelloBytes> Hello::bytes() const {
  std::array<uint8_t, link_wire::kHelloBytes> out{};
  uint8_t* p = out.data();
  p = std::copy(kMagic.begin(), kMagic.end(), p);
  p = std::copy(scope.begin(), scope.end(), p);
  for (int v : {dialer_rank, dialer_incarnation, acceptor_rank, acceptor_incarnation}) {
    put_u32(p, uint32_t(v));
    p += 4;
  }
  p = std::copy(attempt.begin(), attempt.end(), p);
  p = std::copy(nonce.begin(), nonce.end(), p);
  put_u32(p, sealed ? 1 : 0);
  return out;
}

bool Hello::parse(const uint8_t* bytes, Hello* out) {
  if (!std::equal(kMagic.begin(), kMagic.end(), bytes)) return false;
  const uint8_t* p = bytes + kMagic.size();
  std::copy(p, p + link_wire::kScopeBytes, out->scope.begin());
  p += link_wire::kScopeBytes;
  int* fields[] = {&out->dialer_rank, &out->dialer_incarnation, &out->acceptor_rank, &out->acceptor_incarnation};
  for (int* f : fields) {
    *f = int(get_u32(p));
    p += 4;
  }
  std::copy(p, p + link_wire::kAttemptBytes, out->attempt.begin());
  p += link_wire::kAttemptBytes;
  std::copy(p, p + link_wire::kNonceBytes, out->nonce.begin());
  p += link_wire::kNonceBytes;
  const uint32_t sealed = get_u32(p);
  if (sealed > 1) return false;
  out->sealed = sealed == 1;
  return true;
}

LinkPtr dial_handshake(int fd, const LinkKey& key, bool sealed, const LinkEnd& self, const LinkEnd& peer,
                       const std::string& attempt, LinkRoute route, const std::string& relay,
                       Clock::time_point deadline, std::string* problem) {
  Hello hello;
  hello.scope = scope_hash(self.scope);
  hello.dialer_rank = self.rank;
  hello.dialer_incarnation = self.incarnation;
  hello.acceptor_rank = peer.rank;
  hello.acceptor_incarnation = peer.incarnation;
  hello.attempt = attempt_hash(attempt);
  hello.sealed = sealed;
  randombytes_buf(hello.nonce.data(), hello.nonce.size());
  const auto said = hello.bytes();
  std::array<uint8_t, link_wire::kAnswerBytes> answer{};
  auto fail = [&](const std::string& why) {
    *problem = why;
    ::close(fd);
    return LinkPtr();
  };
  if (!write_exactly(fd, said.data(), said.size(), deadline))
    return fail(fmt::format("the hello did not leave: {}", std::strerror(errno)));
  if (!read_exactly(fd, answer.data(), answer.size(), deadline))
    return fail(errno == ETIMEDOUT ? "no answer to the hello in time"
                                   : fmt::format("the connection closed before an answer: {}", std::strerror(errno)));
  const uint8_t* nonce = answer.data();
  const auto expected = bound(key, "noloco link acceptor", said, nonce);
  if (sodium_memcmp(expected.data(), answer.data() + link_wire::kNonceBytes, expected.size()) != 0)
    return fail("the answer does not prove the run's token (another run, or not a worker)");
  const auto proof = bound(key, "noloco link dialer", said, nonce);
  if (!write_exactly(fd, proof.data(), proof.size(), deadline))
    return fail(fmt::format("the proof did not leave: {}", std::strerror(errno)));
  const auto keys = keys_of(key, said, nonce, /*dialer=*/true);
  return std::make_shared<Link>(fd, route, self, peer, keys, sealed, relay);
}

AcceptHandshake::AcceptHandshake(const LinkKey& key, std::function<bool(const Hello&)> wanted)
    : key_(key), wanted_(std::move(wanted)) {}

size_t AcceptHandshake::wants() const {
  return answered_ ? link_wire::kHelloBytes + link_wire::kProofBytes - got_.size()
                   : link_wire::kHelloBytes - got_.size();
}

AcceptHandshake::Step AcceptHandshake::feed(const uint8_t* data, size_t n, size_t* used) {
  const size_t take = std::min(n, wants());
  got_.insert(got_.end(), data, data + take);
  *used = take;
  if (wants() > 0) return Step::more;
  if (!answered_) {
    if (!Hello::parse(got_.data(), &hello_) || !wanted_(hello_)) return Step::refused;
    randombytes_buf(nonce_.data(), nonce_.size());
    const auto mac = bound(key_, "noloco link acceptor", hello_.bytes(), nonce_.data());
    answer_.assign(nonce_.begin(), nonce_.end());
    answer_.insert(answer_.end(), mac.begin(), mac.end());
    answered_ = true;
    return Step::answer;
  }
  const auto expected = bound(key_, "noloco link dialer", hello_.bytes(), nonce_.data());
  if (sodium_memcmp(expected.data(), got_.data() + link_wire::kHelloBytes, expected.size()) != 0) return Step::refused;
  return Step::done;
}

Link::Keys AcceptHandshake::keys() const { return keys_of(key_, hello_.bytes(), nonce_.data(), /*dialer=*/false); }

Link::Link(int fd, LinkRoute route, LinkEnd self, LinkEnd peer, const Keys& keys, bool sealed, const std::string& relay)
    : fd_(fd), route_(route), self_(std::move(self)), peer_(std::move(peer)), sealed_(sealed), relay_(relay), keys_(keys) {
  set_nodelay(fd_);
  // The two direction keys, the same pair at both ends (swapped): their XOR names the link.
  std::array<uint8_t, 32> both{};
  for (size_t i = 0; i < both.size(); ++i) both[i] = keys_.send[i] ^ keys_.receive[i];
  std::array<uint8_t, 8> name{};
  crypto_generichash(name.data(), name.size(), both.data(), both.size(), nullptr, 0);
  uint64_t id = 0;
  for (int i = 0; i < 8; ++i) id |= uint64_t(name[size_t(i)]) << (8 * i);
  id_ = int64_t(id >> 1) + 1;
}

Link::~Link() {
  ::close(fd_);
  sodium_memzero(&keys_, sizeof(keys_));
}

void Link::shut() { fail("shut by this worker"); }

namespace {
constexpr uint8_t kTaken = 0x5a;
}  // namespace

bool Link::confirm(Clock::time_point deadline) {
  std::lock_guard<std::mutex> lock(send_mutex_);
  if (!write_exactly(fd_, &kTaken, 1, deadline)) return fail("the link could not be confirmed to the dialer");
  return true;
}

bool Link::await_confirmation(Clock::time_point deadline, const std::function<bool()>& abandon) {
  std::lock_guard<std::mutex> lock(receive_mutex_);
  for (;;) {
    if (broken_) return false;
    if (wait_for(fd_, POLLIN, std::min(deadline, Clock::now() + std::chrono::milliseconds(50)))) break;
    if (Clock::now() >= deadline) return fail("the peer did not take the link in time");
    if (abandon && abandon()) return fail("given up while the peer had not taken the link");
  }
  uint8_t taken = 0;
  if (!read_exactly(fd_, &taken, 1, deadline) || taken != kTaken)
    return fail("the peer closed the link instead of taking it");
  return true;
}

std::string Link::problem() const {
  std::lock_guard<std::mutex> lock(problem_mutex_);
  return problem_;
}

bool Link::fail(const std::string& why) {
  std::lock_guard<std::mutex> lock(problem_mutex_);
  if (problem_.empty()) problem_ = why;
  // The other end is told at once (its next read ends): a link broken at one
  // end is never used again, and the other must not wait on it.
  if (!broken_.exchange(true)) ::shutdown(fd_, SHUT_RDWR);
  return false;
}

bool Link::write_all(const uint8_t* data, size_t n, Clock::time_point deadline) {
  if (broken_) return false;
  if (!write_exactly(fd_, data, n, deadline))
    return fail(errno == ETIMEDOUT ? "a send timed out" : fmt::format("a send failed: {}", std::strerror(errno)));
  bytes_sent_ += n;
  return true;
}

bool Link::read_all(uint8_t* data, size_t n, Clock::time_point deadline) {
  if (broken_) return false;
  if (!read_exactly(fd_, data, n, deadline))
    return fail(errno == ETIMEDOUT ? "nothing came in time"
                                   : fmt::format("the connection closed: {}", std::strerror(errno)));
  bytes_received_ += n;
  return true;
}

bool Link::far_end_on_local_network() const { return peer_on_local_network(fd_); }

bool Link::send(const std::vector<Part>& parts, Clock::time_point deadline) {
  std::lock_guard<std::mutex> lock(send_mutex_);
  const UplinkShare::Sending pacing(uplink_.get(), fd_);
  if (sealed_ && !pushing_) {
    std::array<uint8_t, kStreamHeader> header{};
    crypto_secretstream_xchacha20poly1305_init_push(&push_, header.data(), keys_.send.data());
    if (!write_all(header.data(), header.size(), deadline)) return false;
    pushing_ = true;
  }
  size_t total = 0;
  for (const auto& p : parts) total += p.size;
  // Frames of up to kMaxChunk bytes, gathered across the parts; the last is tagged.
  std::vector<uint8_t> plain, wire;
  size_t part = 0, offset = 0, left = total;
  do {
    const size_t chunk = std::min(left, kMaxChunk);
    plain.resize(chunk);
    for (size_t filled = 0; filled < chunk;) {
      const size_t take = std::min(chunk - filled, parts[part].size - offset);
      std::memcpy(plain.data() + filled, parts[part].data + offset, take);
      filled += take;
      offset += take;
      if (offset == parts[part].size) ++part, offset = 0;
    }
    while (part < parts.size() && parts[part].size == 0) ++part;
    left -= chunk;
    const bool last = left == 0;
    const uint8_t tag = last ? crypto_secretstream_xchacha20poly1305_TAG_PUSH : crypto_secretstream_xchacha20poly1305_TAG_MESSAGE;
    const size_t body = sealed_ ? chunk + kSealOverhead : chunk + 1;
    wire.resize(4 + body);
    put_u32(wire.data(), uint32_t(body));
    if (sealed_) {
      crypto_secretstream_xchacha20poly1305_push(&push_, wire.data() + 4, nullptr, plain.data(), chunk, nullptr, 0, tag);
    } else {
      wire[4] = tag;
      std::memcpy(wire.data() + 5, plain.data(), chunk);
    }
    if (last && corrupt_next_.exchange(false) && body > 1) wire[4 + body / 2] ^= 0x01;
    if (!write_all(wire.data(), wire.size(), deadline)) return false;
  } while (left > 0);
  return true;
}

int64_t Link::receive(uint8_t* out, size_t capacity, Clock::time_point deadline) {
  return receive(std::vector<Slot>{{out, capacity}}, deadline);
}

int64_t Link::skip(Clock::time_point deadline) {
  int64_t size = 0;
  std::vector<uint8_t> frame(kMaxChunk);
  for (;;) {
    // Frame by frame: a slot of one frame's size is refilled until the tagged last one.
    const auto got = receive_frames({{frame.data(), frame.size()}}, deadline, /*one_frame=*/true);
    if (got.size < 0) return -1;
    size += got.size;
    if (got.last) return size;
  }
}

int64_t Link::receive(const std::vector<Slot>& slots, Clock::time_point deadline) {
  const auto got = receive_frames(slots, deadline, /*one_frame=*/false);
  return got.size;
}

Link::Received Link::receive_frames(const std::vector<Slot>& slots, Clock::time_point deadline, bool one_frame) {
  std::lock_guard<std::mutex> lock(receive_mutex_);
  if (sealed_ && !pulling_) {
    std::array<uint8_t, kStreamHeader> header{};
    if (!read_all(header.data(), header.size(), deadline)) return {-1, false};
    if (crypto_secretstream_xchacha20poly1305_init_pull(&pull_, header.data(), keys_.receive.data()) != 0)
      return fail("the peer's stream header is not valid"), Received{-1, false};
    pulling_ = true;
  }
  size_t capacity = 0;
  for (const auto& s : slots) capacity += s.size;
  size_t size = 0, slot = 0, offset = 0;  // where the next byte lands
  for (;;) {
    std::array<uint8_t, 4> length{};
    if (!read_all(length.data(), length.size(), deadline)) return {-1, false};
    const size_t body = get_u32(length.data());
    const size_t overhead = sealed_ ? kSealOverhead : 1;
    if (body < overhead || body > kMaxChunk + overhead)
      return fail(fmt::format("a frame of {} bytes (at most {})", body, kMaxChunk + overhead)), Received{-1, false};
    frame_.resize(body);
    if (!read_all(frame_.data(), body, deadline)) return {-1, false};
    const size_t chunk = body - overhead;
    if (size + chunk > capacity)
      return fail(fmt::format("a message larger than the {} bytes expected", capacity)), Received{-1, false};
    while (slot < slots.size() && offset == slots[slot].size) ++slot, offset = 0;
    // A frame that lands within one slot is opened in place; one across slots, then scattered.
    const bool in_place = chunk == 0 || offset + chunk <= slots[slot].size;
    uint8_t* to = nullptr;
    if (in_place) {
      to = chunk == 0 ? nullptr : slots[slot].data + offset;
    } else {
      plain_.resize(chunk);
      to = plain_.data();
    }
    uint8_t tag = 0;
    if (sealed_) {
      if (crypto_secretstream_xchacha20poly1305_pull(&pull_, to, nullptr, &tag, frame_.data(), body, nullptr, 0) != 0) {
        unauthentic_ = true;
        return fail("a frame failed authentication (changed on the way, replayed, or sealed with another key)"),
               Received{-1, false};
      }
    } else {
      tag = frame_[0];
      if (chunk > 0) std::memcpy(to, frame_.data() + 1, chunk);
    }
    if (in_place) {
      offset += chunk;
    } else {
      for (size_t done = 0; done < chunk;) {
        while (offset == slots[slot].size) ++slot, offset = 0;
        const size_t take = std::min(chunk - done, slots[slot].size - offset);
        std::memcpy(slots[slot].data + offset, plain_.data() + done, take);
        done += take;
        offset += take;
      }
    }
    size += chunk;
    if (tag == crypto_secretstream_xchacha20poly1305_TAG_PUSH) return {int64_t(size), true};
    if (tag != crypto_secretstream_xchacha20poly1305_TAG_MESSAGE) return fail("a frame with an unknown tag"), Received{-1, false};
    if (one_frame) return {int64_t(size), false};
  }
}

}  // namespace noloco
