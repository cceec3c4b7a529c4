// libFuzzer target: a peer's coded payload (outer-step messages and pipeline
// activations share these decoders). The first bytes choose the codec (type,
// top-k or rotation, block, coset bits) and the length; the rest is the
// payload. Decoding must give values or a std::runtime_error, never a crash,
// an out-of-bounds access or undefined behaviour.
#include <cstdint>
#include <iterator>
#include <stdexcept>
#include <vector>

#include "wire/codec.h"
#include "wire/coset_codec.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 4) return 0;
  const uint8_t choice = data[0];
  const size_t n = size_t(data[1]) | (size_t(data[2]) << 8);  // up to 65535 values
  const int64_t block = int64_t(8) << (data[3] % 5);          // 8 .. 128
  const uint8_t* payload = data + 4;
  const size_t bytes = size - 4;
  std::vector<float> out(n), side(n, 0.125f);
  try {
    if (choice & 0x80) {
      const noloco::CosetCodec coset(2 + (choice % 7), block);
      std::vector<uint8_t> failed;
      coset.decode(payload, bytes, n, side.data(), out.data(), &failed);
    } else {
      noloco::CodecSpec spec;
      constexpr size_t kTypes = std::size(noloco::kCodecTypes);
      spec.type = noloco::kCodecTypes[choice % kTypes].type;
      // Dense, rotated, or a top-k fraction.
      constexpr double kTopk[] = {0.004, 0.0156, 0.01, 0.03, 0.25};
      const int variant = int(choice / kTypes) % 7;
      spec.rotate = variant == 1 && noloco::integer_code(spec.type);
      spec.topk = variant < 2 ? 0.0 : kTopk[variant - 2];
      spec.block = block;
      const noloco::WireCodec codec(spec);
      codec.decode(payload, bytes, n, out.data());
    }
  } catch (const std::runtime_error&) {
  }
  return 0;
}
