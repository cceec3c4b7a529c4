// Coset coding (Wyner–Ziv coding with side information): how to send a
// vector x to a receiver that already holds a vector y close to it, without
// knowing y. The sender rounds x to a grid of step s (per block) and sends
// only the low `bits` bits of each grid index k = round(x / s). The receiver
// picks, among the grid points with those low bits, the one nearest its own
// y. That is k exactly whenever |x − y| < (2^(bits−1) − 1)·s, so the error is
// at most s/2 however large x is: the bits buy resolution within the
// disagreement, not within x. A 16-bit checksum per block detects a block
// whose disagreement exceeded the range; the receiver then keeps y there.
//
// NoLoCo sends its slow weights φ this way: replicas' φ differ by ~1e-3
// while φ itself is ~1e-1, so 4 bits do what plain int8 of φ cannot.
// Torch-free; the decoder reads a peer's untrusted bytes and is fuzzed.
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

namespace noloco {

class CosetCodec {
 public:
  // bits in [2, 8]; block in [8, 4096]; throws std::invalid_argument.
  CosetCodec(int bits, int64_t block);
  int bits() const { return bits_; }
  size_t block() const { return block_; }
  size_t blocks(size_t n) const { return (n + block_ - 1) / block_; }
  // Exact encoded size of n values: per block a bf16 step and a 16-bit
  // checksum, then `bits` bits a value.
  size_t encoded_bytes(size_t n) const;
  int64_t format_id() const;
  // Half-width of what decodes correctly, in steps.
  int range_in_steps() const { return (1 << (bits_ - 1)) - 1; }

  // steps[b] > 0 is the grid step of block b (rounded to bf16 on the wire;
  // raised where a block's values would need more than 2^30 steps).
  // Stochastic rounding (seeded) makes the decoded value unbiased.
  void encode(const float* x, size_t n, const float* steps, uint8_t* out, bool stochastic, uint64_t seed) const;
  // Decodes against the receiver's own `side`; block b's flag in `failed`
  // (resized to blocks(n)) is set where its checksum did not match, and its
  // values are then `side`'s. Returns the number of failed blocks. Throws
  // std::runtime_error on malformed input (size, non-finite or non-positive step).
  size_t decode(const uint8_t* in, size_t bytes, size_t n, const float* side, float* out,
                std::vector<uint8_t>* failed) const;
  // The step of block b of an encoded message, as the receiver reads it.
  float step_of(const uint8_t* in, size_t b) const;

 private:
  int bits_;
  size_t block_;
};

}  // namespace noloco
