// libFuzzer target: a sealed message as it comes off the wire (comm/transport/seal.h):
// the header, then a sealed payload. Bytes off the wire must never open
// (they would need the run's key), and a payload this target seals itself
// must open only as it was sealed: one flipped byte, chosen by the input,
// and it must not. What opens is decoded as a peer's coded payload.
#include <cstdint>
#include <iterator>
#include <cstdlib>
#include <stdexcept>
#include <vector>

#include "comm/transport/seal.h"
#include "wire/codec.h"
#include "wire/message.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const noloco::Seal seal("fuzzing token");
  if (size < noloco::MessageHeader::kBytes + 3) return 0;
  int64_t words[noloco::MessageHeader::kWords];
  for (int i = 0; i < noloco::MessageHeader::kWords; ++i) {
    uint64_t w = 0;
    for (int b = 0; b < 8; ++b) w |= uint64_t(data[i * 8 + b]) << (8 * b);
    words[i] = int64_t(w);
  }
  const auto header = noloco::MessageHeader::from_words(words);
  const auto context = noloco::seal_context({header.words()[3], header.words()[7]});
  (void)noloco::check_message_header(noloco::MessageHeader{}, header);
  const uint8_t mode = data[noloco::MessageHeader::kBytes];
  const uint16_t flip = uint16_t(data[noloco::MessageHeader::kBytes + 1] | (data[noloco::MessageHeader::kBytes + 2] << 8));
  const uint8_t* rest = data + noloco::MessageHeader::kBytes + 3;
  const size_t n = size - noloco::MessageHeader::kBytes - 3;
  std::vector<uint8_t> plain;
  if (mode & 1) {
    // Off the wire: never opens.
    if (n < noloco::Seal::kOverhead) return 0;
    plain.resize(n - noloco::Seal::kOverhead);
    if (seal.open(rest, plain.size(), context, plain.data())) std::abort();
    return 0;
  }
  std::vector<uint8_t> sealed(n + noloco::Seal::kOverhead);
  seal.seal(rest, n, context, sealed.data());
  const bool changed = (mode & 2) != 0;
  if (changed) sealed[flip % sealed.size()] ^= uint8_t(1 + (mode >> 2));
  plain.resize(n);
  const bool opened = seal.open(sealed.data(), n, context, plain.data());
  if (opened == changed) std::abort();
  if (!opened) return 0;
  if (!std::equal(plain.begin(), plain.end(), rest)) std::abort();
  noloco::CodecSpec spec;
  spec.type = noloco::kCodecTypes[mode % std::size(noloco::kCodecTypes)].type;
  spec.block = 64;
  std::vector<float> out(plain.size());
  try {
    noloco::WireCodec(spec).decode(plain.data(), plain.size(), out.size(), out.data());
  } catch (const std::runtime_error&) {
  }
  return 0;
}
