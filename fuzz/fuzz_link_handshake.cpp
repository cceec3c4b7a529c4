// libFuzzer target: what a stranger sends to a worker's link port or a
// relay's listener arrives at the acceptor's half of the links' handshake
// (comm/link/link.h), in pieces of any size. It must never crash and never
// complete: finishing needs a MAC under the run's key. Whatever parses as a
// hello must read back to the same bytes.
#include <algorithm>
#include <cstdint>
#include <cstdlib>

#include "comm/link/link.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  if (size >= noloco::link_wire::kHelloBytes + 1) {
    noloco::Hello hello;
    if (noloco::Hello::parse(data + 1, &hello)) {
      const auto again = hello.bytes();
      if (!std::equal(again.begin(), again.end(), data + 1)) std::abort();
    }
  }
  noloco::LinkKey key{};
  key.fill(7);
  noloco::AcceptHandshake handshake(key, [&](const noloco::Hello&) { return data[0] & 1; });
  const size_t piece = 1 + data[0] / 2;  // the pieces the bytes arrive in
  for (size_t at = 1; at < size;) {
    size_t used = 0;
    const auto step = handshake.feed(data + at, std::min(piece, size - at), &used);
    if (step == noloco::AcceptHandshake::Step::done) std::abort();  // a stranger proved a key it does not have
    if (step == noloco::AcceptHandshake::Step::refused) return 0;
    if (used == 0 && step == noloco::AcceptHandshake::Step::more) std::abort();  // took nothing, wants more: a hang
    at += used;
  }
  return 0;
}
