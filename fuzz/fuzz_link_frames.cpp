// libFuzzer target: what a link's far end sends after the handshake
// (comm/link/link.h), read by Link::receive into slots of any layout, or
// passed over by Link::skip. It must never crash, hang, or write past the
// slots. Sealed, bytes the input makes up must never open, and a message
// this target sends through a real sending end must arrive exactly as sent,
// unless the input flips one of its bytes on the way, when it must not
// arrive at all. In clear, what arrives is what the frames carried.
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <vector>

#include "comm/link/link.h"

namespace {

using noloco::Link;

// The frames' payloads in clear, up to the one tagged last; false if the
// bytes hold no whole message or a frame the receiver must refuse.
bool frames_in_clear(const std::vector<uint8_t>& wire, std::vector<uint8_t>* message) {
  for (size_t at = 0;;) {
    if (wire.size() - at < 4) return false;
    const size_t body = size_t(wire[at]) | size_t(wire[at + 1]) << 8 | size_t(wire[at + 2]) << 16 | size_t(wire[at + 3]) << 24;
    at += 4;
    if (body < 1 || body > Link::kMaxChunk + 1 || wire.size() - at < body) return false;
    const uint8_t tag = wire[at];
    message->insert(message->end(), wire.begin() + long(at) + 1, wire.begin() + long(at + body));
    at += body;
    if (tag == crypto_secretstream_xchacha20poly1305_TAG_PUSH) return true;
    if (tag != crypto_secretstream_xchacha20poly1305_TAG_MESSAGE) return false;
  }
}

// What a real sending end puts on the wire for one message of `message`.
std::vector<uint8_t> sent_wire(const Link::Keys& keys, bool sealed, const std::vector<uint8_t>& message) {
  int pair[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM, 0, pair) != 0) std::abort();
  {
    Link::Keys swapped;
    swapped.send = keys.receive;
    swapped.receive = keys.send;
    Link sender(pair[0], noloco::LinkRoute::direct, {"fuzz", 1, 0}, {"fuzz", 0, 0}, swapped, sealed, "");
    if (!sender.send({{message.data(), message.size()}}, noloco::Clock::now() + std::chrono::seconds(5))) std::abort();
  }  // closes its end: the reader below meets the end of the stream
  std::vector<uint8_t> wire;
  uint8_t buf[4096];
  for (ssize_t n; (n = ::read(pair[1], buf, sizeof buf)) > 0;) wire.insert(wire.end(), buf, buf + n);
  ::close(pair[1]);
  return wire;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const bool ready = sodium_init() >= 0;
  if (!ready) std::abort();
  if (size < 3) return 0;
  const uint8_t mode = data[0];
  const bool sealed = mode & 1, through_sender = mode & 2, skipping = mode & 4;
  const size_t flip = size_t(data[1]) | size_t(data[2]) << 8;  // past the wire's end: none
  const std::vector<uint8_t> rest(data + 3, data + size);
  Link::Keys keys;
  keys.send.fill(3);
  keys.receive.fill(5);

  std::vector<uint8_t> wire = through_sender ? sent_wire(keys, sealed, rest) : rest;
  const bool flipped = through_sender && flip < wire.size();
  if (flipped) wire[flip] ^= 0x01;
  // The slots: one to four, of sizes the input picks (zero among them).
  const size_t slots = 1 + ((mode >> 3) & 3), unit = mode >> 5;
  std::vector<std::vector<uint8_t>> buffers;
  for (size_t i = 0; i < slots; ++i) buffers.emplace_back((unit * 97 + i * 61) % 1200);
  std::vector<Link::Slot> layout;
  size_t capacity = 0;
  for (auto& b : buffers) {
    layout.push_back({b.data(), b.size()});
    capacity += b.size();
  }

  int pair[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM, 0, pair) != 0) std::abort();
  // Small enough to stay below the pair's buffer: written whole before any read.
  if (::write(pair[0], wire.data(), wire.size()) != ssize_t(wire.size())) std::abort();
  ::close(pair[0]);
  Link receiver(pair[1], noloco::LinkRoute::direct, {"fuzz", 0, 0}, {"fuzz", 1, 0}, keys, sealed, "");
  const auto deadline = noloco::Clock::now() + std::chrono::seconds(5);
  const int64_t got = skipping ? receiver.skip(deadline) : receiver.receive(layout, deadline);
  if (got >= 0 && receiver.broken()) std::abort();
  if (!skipping && got > int64_t(capacity)) std::abort();

  std::vector<uint8_t> arrived;
  for (const auto& b : buffers) arrived.insert(arrived.end(), b.begin(), b.end());
  arrived.resize(std::max<int64_t>(got, 0));
  if (sealed) {
    if (!through_sender || flipped) {
      if (got >= 0) std::abort();  // opened without the key, or changed on the way
      return 0;
    }
    if (skipping ? got != int64_t(rest.size()) : (rest.size() <= capacity) != (got >= 0)) std::abort();
    if (!skipping && got >= 0 && arrived != rest) std::abort();
    return 0;
  }
  std::vector<uint8_t> expected;
  const bool whole = frames_in_clear(wire, &expected);
  if (skipping ? got != (whole ? int64_t(expected.size()) : -1)
               : (whole && expected.size() <= capacity) != (got >= 0))
    std::abort();
  if (!skipping && got >= 0 && arrived != expected) std::abort();
  return 0;
}
