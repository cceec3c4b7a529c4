#include "wire/coset_codec.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>

#include <fmt/format.h>

#include "wire/bytes.h"
#include "util/splitmix.h"

namespace noloco {

namespace {

constexpr double kMaxSteps = 1073741824.0;  // 2^30: grid indices stay exact in a double and in int64

using namespace wire;

double uniform(uint64_t seed, uint64_t i) { return double(splitmix64(seed ^ splitmix64(i)) >> 11) * 0x1.0p-53; }

// Weighted so that one wrapped index (off by ±2^bits) never leaves it unchanged.
uint16_t add_to_checksum(uint16_t sum, size_t position_in_block, int64_t k) {
  return uint16_t(sum + uint16_t(uint64_t(position_in_block + 1) * uint64_t(k)));
}

}  // namespace

CosetCodec::CosetCodec(int bits, int64_t block) : bits_(bits), block_(size_t(block)) {
  if (bits < 2 || bits > 8) throw std::invalid_argument(fmt::format("phi_bits must be in [2, 8], got {}", bits));
  if (block < 8 || block > 4096) throw std::invalid_argument(fmt::format("quant_block must be in [8, 4096], got {}", block));
}

size_t CosetCodec::encoded_bytes(size_t n) const { return 4 * blocks(n) + (n * size_t(bits_) + 7) / 8; }

int64_t CosetCodec::format_id() const { return 0x100000 | (int64_t(bits_) << 16) | int64_t(block_); }

float CosetCodec::step_of(const uint8_t* in, size_t b) const { return from_bf16(get16(in + 4 * b)); }

void CosetCodec::encode(const float* x, size_t n, const float* steps, uint8_t* out, bool stochastic,
                        uint64_t seed) const {
  const size_t nb = blocks(n);
  uint8_t* codes = out + 4 * nb;
  std::memset(codes, 0, (n * size_t(bits_) + 7) / 8);
  const uint32_t mask = (1u << bits_) - 1;
  for (size_t b = 0; b < nb; ++b) {
    const size_t first = b * block_, last = std::min(n, first + block_);
    float peak = 0;
    for (size_t i = first; i < last; ++i) peak = std::max(peak, std::fabs(x[i]));
    const float wanted = std::max({steps[b], float(double(peak) / kMaxSteps), 1e-30f});
    const uint16_t step_bits = to_bf16_up(wanted);
    const double step = from_bf16(step_bits);
    uint16_t checksum = 0;
    for (size_t i = first; i < last; ++i) {
      const double v = double(x[i]) / step;
      const auto k = int64_t(stochastic ? std::floor(v + uniform(seed, i)) : std::nearbyint(v));
      checksum = add_to_checksum(checksum, i - first, k);
      const uint32_t code = uint32_t(uint64_t(k) & mask);
      const size_t bit = i * size_t(bits_);
      const uint32_t shifted = code << (bit % 8);
      codes[bit / 8] |= uint8_t(shifted & 0xff);
      if ((bit % 8) + size_t(bits_) > 8) codes[bit / 8 + 1] |= uint8_t(shifted >> 8);
    }
    put16(out + 4 * b, step_bits);
    put16(out + 4 * b + 2, checksum);
  }
}

size_t CosetCodec::decode(const uint8_t* in, size_t bytes, size_t n, const float* side, float* out,
                          std::vector<uint8_t>* failed) const {
  if (bytes != encoded_bytes(n))
    malformed(fmt::format("{} bytes where {} coset-coded values take {}", bytes, n, encoded_bytes(n)));
  const size_t nb = blocks(n);
  if (failed) failed->assign(nb, 0);
  const uint8_t* codes = in + 4 * nb;
  const int64_t modulus = int64_t(1) << bits_, half = modulus / 2;
  const uint32_t mask = uint32_t(modulus - 1);
  size_t failures = 0;
  for (size_t b = 0; b < nb; ++b) {
    const double step = step_of(in, b);
    if (!std::isfinite(step) || !(step > 0)) malformed(fmt::format("block {} has step {}", b, step));
    const size_t first = b * block_, last = std::min(n, first + block_);
    uint16_t checksum = 0;
    bool decodable = true;
    for (size_t i = first; i < last; ++i) {
      const double own = double(side[i]) / step;
      if (!(std::fabs(own) < 4 * kMaxSteps)) {  // our own weights are off this grid: cannot place the value
        decodable = false;
        break;
      }
      const int64_t k_own = int64_t(std::nearbyint(own));
      const size_t bit = i * size_t(bits_);
      uint32_t code = uint32_t(codes[bit / 8]) >> (bit % 8);
      if ((bit % 8) + size_t(bits_) > 8) code |= uint32_t(codes[bit / 8 + 1]) << (8 - bit % 8);
      int64_t d = int64_t((uint64_t(code) - uint64_t(k_own)) & mask);
      if (d >= half) d -= modulus;
      const int64_t k = k_own + d;
      checksum = add_to_checksum(checksum, i - first, k);
      out[i] = float(double(k) * step);
    }
    if (!decodable || checksum != get16(in + 4 * b + 2)) {
      std::copy(side + first, side + last, out + first);
      if (failed) (*failed)[b] = 1;
      ++failures;
    }
  }
  const size_t pad_bits = (8 - (n * size_t(bits_)) % 8) % 8;
  if (pad_bits > 0 && (codes[(n * size_t(bits_)) / 8] >> (8 - pad_bits)) != 0) malformed("padding is not zero");
  return failures;
}

}  // namespace noloco
