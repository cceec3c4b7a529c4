// Wire codecs: a flat fp32 array to bytes and back, with the exact byte
// count known in advance from the length alone (receivers post buffers of
// that size before anything arrives). Torch-free: the decoder reads a peer's
// untrusted bytes and is fuzzed.
//
//   fp32   4 bytes a value, exact.
//   bf16   2 bytes, round to nearest even (as LibTorch's conversion).
//   int8   blocks of `block` values share a scale (bf16, rounded up so that
//          no value overflows): q = round(x / scale) in [-127, 127].
//   int4   the same with q in [-7, 7], two values a byte;
//   int3   q in [-3, 3], 3 bits; int2: q in [-1, 1] (ternary), 2 bits.
//   bins2  2 bits a value, its sign and whether its magnitude is in the
//          block's upper or lower bin (split where the two bins' means meet,
//          Lloyd's two-level quantizer); each block sends the two bins' mean
//          magnitudes (bf16) and every value decodes to its bin's mean. No
//          value rounds to zero: suited to the top-k values, all large
//          (SparseLoCo's 2-bit bin means, with the bins per block).
// Optionally rotated (dense integer codes): each whole block goes through a
// fixed randomized Hadamard transform before coding and back after decoding,
// which spreads outliers so the block's scale fits its typical value.
// Optionally top-k: in every chunk of 4096 values only the k = ceil(topk·len)
// largest in magnitude travel (their positions Rice-coded in a fixed number
// of bits per chunk, 8.0 a position at 64 of 4096; then their values in the
// codec above); the others decode to zero. Stochastic rounding makes the
// integer codes unbiased: E[decode(encode(x))] = x for the values sent.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

namespace noloco {

struct CodecSpec {
  enum class Type { fp32, bf16, int8, int4, int3, int2, bins2 };
  Type type = Type::fp32;
  double topk = 0;       // fraction of each chunk sent; 0: all (dense)
  int64_t block = 64;    // values per scale (int8, int4)
  bool stochastic = false;  // stochastic rounding of the integer codes
  bool rotate = false;      // randomized Hadamard transform of each block (power-of-two block)
};

// The one description of the codec types: the name users write in a config
// (wire_dtype, activation_codec, ...), how a value is coded, its bits, and
// the bytes each block of `block` values carries before the codes (its
// scale, its bin means; 0: values stand alone). A new type is a row here,
// its coding in codec.cpp, and its tests.
enum class Coding {
  floating,        // fp32, bf16: each value on its own
  scaled_integer,  // q in [-(2^(bits-1) - 1), 2^(bits-1) - 1] times the block's scale
  bin_means,       // sign and bin, times the bin's mean magnitude
};
struct CodecType {
  CodecSpec::Type type;
  const char* name;
  Coding coding;
  int value_bits;
  int block_bytes;
};
inline constexpr CodecType kCodecTypes[] = {
    {CodecSpec::Type::fp32, "fp32", Coding::floating, 32, 0},
    {CodecSpec::Type::bf16, "bf16", Coding::floating, 16, 0},
    {CodecSpec::Type::int8, "int8", Coding::scaled_integer, 8, 2},
    {CodecSpec::Type::int4, "int4", Coding::scaled_integer, 4, 2},
    {CodecSpec::Type::int3, "int3", Coding::scaled_integer, 3, 2},
    {CodecSpec::Type::int2, "int2", Coding::scaled_integer, 2, 2},
    {CodecSpec::Type::bins2, "bins2", Coding::bin_means, 2, 4},
};

const char* codec_type_name(CodecSpec::Type type);
// The type of that name (as codec_type_name writes it); throws std::invalid_argument.
CodecSpec::Type codec_type_named(const std::string& name);
// int8, int4, int3, int2: scaled blocks (the codes that can be rotated).
bool integer_code(CodecSpec::Type type);
// Whether values travel in blocks that share what the block carries (a
// scale, bin means): every type but the float formats. Such a code suits a
// change of the weights, never the weights themselves.
bool blockwise_code(CodecSpec::Type type);

class WireCodec {
 public:
  static constexpr size_t kChunk = 4096;  // top-k chunk

  // Throws std::invalid_argument on a spec out of range.
  explicit WireCodec(CodecSpec spec);
  const CodecSpec& spec() const { return spec_; }
  // Exact encoded size of n values.
  size_t encoded_bytes(size_t n) const;
  // Identifies the format in message headers: peers must agree on it.
  int64_t format_id() const;
  std::string describe() const;
  // Whether decode(encode(x)) == x for every finite x.
  bool lossless() const { return spec_.type == CodecSpec::Type::fp32 && spec_.topk == 0; }

  // out must hold encoded_bytes(n). `seed` drives stochastic rounding (the
  // same seed and input give the same bytes).
  void encode(const float* x, size_t n, uint8_t* out, uint64_t seed) const;
  // Writes n values; throws std::runtime_error with a one-line reason on any
  // malformed input (wrong size, non-finite or negative scale, a code the
  // encoder never writes, positions out of order or range). Never reads or
  // writes out of bounds.
  void decode(const uint8_t* in, size_t bytes, size_t n, float* out) const;

 private:
  // Dense encoding of n values (the selected values under top-k).
  size_t dense_bytes(size_t n) const;
  void encode_dense(const float* x, size_t n, uint8_t* out, uint64_t seed) const;
  void decode_dense(const uint8_t* in, size_t n, float* out) const;
  void encode_bins(const float* x, size_t n, uint8_t* out) const;
  void decode_bins(const uint8_t* in, size_t n, float* out) const;
  size_t chunk_k(size_t chunk_len) const;
  // A top-k message of n values: the values sent, and the bits of all chunks' positions before them.
  struct TopKSize {
    size_t values = 0, position_bits = 0;
  };
  TopKSize topk_size(size_t n) const;
  // Only whole blocks rotate (a power of two long); a short last block goes as it is.
  bool rotates(size_t block_len) const { return spec_.rotate && block_len == size_t(spec_.block); }

  CodecSpec spec_;
};

}  // namespace noloco
