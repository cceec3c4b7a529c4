// The byte-level pieces the wire codecs share: little-endian 16-bit fields,
// bf16 conversions and the error a malformed peer payload raises.
// Torch-free, like the codecs whose untrusted-input decoders use it.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

namespace noloco::wire {

[[noreturn]] inline void malformed(const std::string& why) {
  throw std::runtime_error("malformed payload: " + why);
}

inline uint32_t bits_of(float x) {
  uint32_t b;
  std::memcpy(&b, &x, 4);
  return b;
}

inline float float_of(uint32_t b) {
  float x;
  std::memcpy(&x, &b, 4);
  return x;
}

// Round to nearest even, as c10::BFloat16 does.
inline uint16_t to_bf16(float x) {
  if (std::isnan(x)) return 0x7fc0;
  const uint32_t b = bits_of(x);
  return uint16_t((b + ((b >> 16) & 1u) + 0x7fffu) >> 16);
}

// The smallest bf16 not below x (x >= 0): a scale or step rounded this way
// never falls below what was needed.
inline uint16_t to_bf16_up(float x) {
  const uint32_t b = bits_of(x);
  return uint16_t((b >> 16) + ((b & 0xffffu) != 0 ? 1u : 0u));
}

inline float from_bf16(uint16_t h) { return float_of(uint32_t(h) << 16); }

inline void put16(uint8_t* p, uint16_t v) {
  p[0] = uint8_t(v & 0xff);
  p[1] = uint8_t(v >> 8);
}

inline uint16_t get16(const uint8_t* p) { return uint16_t(p[0] | (uint16_t(p[1]) << 8)); }

}  // namespace noloco::wire
