#include "wire/codec.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <stdexcept>
#include <vector>

#include <fmt/format.h>

#include "wire/bytes.h"
#include "util/splitmix.h"

namespace noloco {

namespace {

using namespace wire;

// A uniform draw in [0, 1) for element `i`, a pure function of (seed, i).
float uniform(uint64_t seed, uint64_t i) {
  return float(splitmix64(seed ^ splitmix64(i)) >> 40) * (1.0f / 16777216.0f);
}

// Bits of an integer code: q in [-qmax, qmax], qmax = 2^(bits-1) - 1,
// stored offset (q + 2^(bits-1)) in a little-endian bit stream, so the
// lowest code (offset 0) is never written and padding bits are zero.
const CodecType& described(CodecSpec::Type t) {
  for (const auto& d : kCodecTypes)
    if (d.type == t) return d;
  throw std::logic_error("a codec type without a row in kCodecTypes");
}

int bits_of_type(CodecSpec::Type t) { return described(t).value_bits; }

size_t ceil_div(size_t a, size_t b) { return (a + b - 1) / b; }

void put_code(uint8_t* codes, size_t i, int bits, unsigned offset_code) {
  const size_t bit = i * size_t(bits);
  const unsigned v = offset_code << (bit % 8);
  codes[bit / 8] |= uint8_t(v & 0xff);
  if (bit % 8 + size_t(bits) > 8) codes[bit / 8 + 1] |= uint8_t(v >> 8);
}

unsigned get_code(const uint8_t* codes, size_t i, int bits) {
  const size_t bit = i * size_t(bits);
  unsigned v = codes[bit / 8];
  if (bit % 8 + size_t(bits) > 8) v |= unsigned(codes[bit / 8 + 1]) << 8;
  return (v >> (bit % 8)) & ((1u << bits) - 1);
}

// The randomized Hadamard transform of one block of length m (a power of
// two): y = H·D·x/√m, D a fixed ±1 diagonal drawn from the position. It is
// orthogonal, so it keeps the block's energy but spreads an outlier over
// every value, and the peak that sets the block's scale falls toward the
// typical magnitude. Its inverse is x = D·H·y/√m.
float rotation_sign(size_t i) { return (splitmix64(0x726f74617465ull ^ splitmix64(i)) & 1) ? -1.0f : 1.0f; }

void hadamard(float* v, size_t m) {
  for (size_t h = 1; h < m; h *= 2)
    for (size_t i = 0; i < m; i += 2 * h)
      for (size_t j = i; j < i + h; ++j) {
        const float a = v[j], b = v[j + h];
        v[j] = a + b;
        v[j + h] = a - b;
      }
  const float norm = 1.0f / std::sqrt(float(m));
  for (size_t i = 0; i < m; ++i) v[i] *= norm;
}

void rotate_block(const float* x, size_t first, size_t m, float* y) {
  for (size_t i = 0; i < m; ++i) y[i] = x[i] * rotation_sign(first + i);
  hadamard(y, m);
}

void unrotate_block(float* v, size_t first, size_t m) {
  hadamard(v, m);
  for (size_t i = 0; i < m; ++i) v[i] *= rotation_sign(first + i);
}

// Top-k positions, Rice-coded. A chunk's k sorted positions become gaps
// g = p - previous - 1 (g >= 0, their sum at most len - k); each gap is its
// quotient g >> r in unary (ones, then a zero) and its low r bits. Whatever
// the positions, the chunk takes at most k(r + 1) + ((len - k) >> r) bits,
// so every chunk gets exactly that many (zeros after its codes) and the
// message keeps a size known from its length alone. With r chosen to make
// the bound smallest, 64 of 4096 take 510 bits (8.0 a position, against 12
// fixed-width and log2 C(4096, 64) / 64 = 7.4 at their entropy).
int rice_parameter(size_t len, size_t k) {
  int best = 0;
  for (int r = 1; r < 13; ++r)
    if (k * size_t(r + 1) + ((len - k) >> r) < k * size_t(best + 1) + ((len - k) >> best)) best = r;
  return best;
}

size_t position_bits(size_t len, size_t k) {
  const int r = rice_parameter(len, k);
  return k * size_t(r + 1) + ((len - k) >> r);
}

void put_bit(uint8_t* out, size_t bit, bool one) {
  if (one) out[bit / 8] |= uint8_t(1u << (bit % 8));
}

bool get_bit(const uint8_t* in, size_t bit) { return (in[bit / 8] >> (bit % 8)) & 1u; }

// Writes one chunk's sorted positions from bit `at`; `out` is zeroed.
void write_positions(const uint32_t* positions, size_t len, size_t k, uint8_t* out, size_t at) {
  const int r = rice_parameter(len, k);
  int64_t previous = -1;
  for (size_t j = 0; j < k; ++j) {
    const uint32_t gap = uint32_t(int64_t(positions[j]) - previous - 1);
    for (uint32_t q = gap >> r; q > 0; --q) put_bit(out, at++, true);
    ++at;  // the unary code's terminating zero
    for (int b = 0; b < r; ++b) put_bit(out, at++, (gap >> b) & 1u);
    previous = positions[j];
  }
}

// Reads them back, refusing codes that run past the chunk's bits, positions
// past its end, and anything but zeros after the last code.
void read_positions(const uint8_t* in, size_t at, size_t len, size_t k, uint32_t* positions) {
  const int r = rice_parameter(len, k);
  const size_t end = at + position_bits(len, k);
  int64_t previous = -1;
  for (size_t j = 0; j < k; ++j) {
    uint64_t gap = 0;
    for (;; ++gap) {
      if (at >= end) malformed(fmt::format("position code {} of {} runs past its chunk", j, k));
      if (!get_bit(in, at++)) break;
    }
    if (at + size_t(r) > end) malformed(fmt::format("position code {} of {} runs past its chunk", j, k));
    gap <<= r;
    for (int b = 0; b < r; ++b) gap |= uint64_t(get_bit(in, at++)) << b;
    const int64_t p = previous + 1 + int64_t(gap);
    if (p >= int64_t(len)) malformed(fmt::format("position {} in a chunk of {}", p, len));
    positions[j] = uint32_t(p);
    previous = p;
  }
  for (; at < end; ++at)
    if (get_bit(in, at)) malformed("position padding is not zero");
}

// Lloyd's two-level quantizer of a block's magnitudes: the split between
// the bins sits where their means meet, so each value decodes to the nearer
// mean. A few rounds from the mean magnitude settle it; the means returned
// are those of the split returned.
struct TwoBins {
  float split = 0, low = 0, high = 0;
};
TwoBins two_bins(const float* x, size_t m) {
  double total = 0;
  for (size_t i = 0; i < m; ++i) total += std::fabs(x[i]);
  TwoBins bins;
  float split = float(total / double(m));
  for (int round = 0; round < 4; ++round) {
    double low = 0, high = 0;
    size_t lows = 0, highs = 0;
    for (size_t i = 0; i < m; ++i) {
      const float a = std::fabs(x[i]);
      if (a > split) {
        high += a;
        ++highs;
      } else {
        low += a;
        ++lows;
      }
    }
    bins.split = split;
    bins.low = lows ? float(low / double(lows)) : 0.0f;
    bins.high = highs ? float(high / double(highs)) : bins.low;
    split = 0.5f * (bins.low + bins.high);
    if (split == bins.split) break;
  }
  return bins;
}

}  // namespace

bool integer_code(CodecSpec::Type type) { return described(type).coding == Coding::scaled_integer; }

bool blockwise_code(CodecSpec::Type type) { return described(type).block_bytes > 0; }

const char* codec_type_name(CodecSpec::Type type) { return described(type).name; }

CodecSpec::Type codec_type_named(const std::string& name) {
  for (const auto& d : kCodecTypes)
    if (name == d.name) return d.type;
  throw std::invalid_argument("no wire codec named '" + name + "'");
}

WireCodec::WireCodec(CodecSpec spec) : spec_(spec) {
  if (!(spec_.topk >= 0 && spec_.topk < 1))
    throw std::invalid_argument(fmt::format("topk must be in [0, 1), got {}", spec_.topk));
  if (spec_.block < 8 || spec_.block > 4096)
    throw std::invalid_argument(fmt::format("quant_block must be in [8, 4096], got {}", spec_.block));
  if (spec_.rotate && (!integer_code(spec_.type) || spec_.topk > 0 || (spec_.block & (spec_.block - 1)) != 0))
    throw std::invalid_argument("rotation needs a dense integer codec and a power-of-two quant_block");
}

size_t WireCodec::chunk_k(size_t chunk_len) const {
  return std::min(chunk_len, std::max<size_t>(1, size_t(std::ceil(spec_.topk * double(chunk_len)))));
}

size_t WireCodec::dense_bytes(size_t n) const {
  const auto& type = described(spec_.type);
  return size_t(type.block_bytes) * ceil_div(n, size_t(spec_.block)) + ceil_div(n * size_t(type.value_bits), 8);
}

WireCodec::TopKSize WireCodec::topk_size(size_t n) const {
  TopKSize size;
  for (size_t first = 0; first < n; first += kChunk) {
    const size_t len = std::min(kChunk, n - first), k = chunk_k(len);
    size.values += k;
    size.position_bits += position_bits(len, k);
  }
  return size;
}

size_t WireCodec::encoded_bytes(size_t n) const {
  if (spec_.topk == 0) return dense_bytes(n);
  const auto size = topk_size(n);
  return ceil_div(size.position_bits, 8) + dense_bytes(size.values);
}

int64_t WireCodec::format_id() const {
  // 0x40: Rice-coded positions (an earlier format had them 12 bits wide).
  return (int64_t(spec_.type) + 1) | (spec_.rotate ? 0x80 : 0) | (spec_.topk > 0 ? 0x40 : 0) | (spec_.block << 8) |
         (int64_t(std::llround(spec_.topk * 1e6)) << 24);
}

std::string WireCodec::describe() const {
  std::string s = codec_type_name(spec_.type);
  if (integer_code(spec_.type))
    s += fmt::format(" ({}-value blocks{}{})", spec_.block, spec_.rotate ? ", rotated" : "",
                     spec_.stochastic ? ", stochastic rounding" : "");
  else if (blockwise_code(spec_.type))
    s += fmt::format(" ({}-value blocks)", spec_.block);
  if (spec_.topk > 0) s += fmt::format(", top {:g}%", spec_.topk * 100);
  return s;
}

void WireCodec::encode_dense(const float* x, size_t n, uint8_t* out, uint64_t seed) const {
  switch (spec_.type) {
    case CodecSpec::Type::fp32:
      for (size_t i = 0; i < n; ++i) std::memcpy(out + 4 * i, &x[i], 4);  // little-endian, as the hosts we run on
      return;
    case CodecSpec::Type::bf16:
      for (size_t i = 0; i < n; ++i) put16(out + 2 * i, to_bf16(x[i]));
      return;
    case CodecSpec::Type::bins2: return encode_bins(x, n, out);
    default: break;
  }
  const int bits = bits_of_type(spec_.type), qmax = (1 << (bits - 1)) - 1;
  const size_t block = size_t(spec_.block), blocks = ceil_div(n, block);
  uint8_t* codes = out + 2 * blocks;
  std::memset(codes, 0, ceil_div(n * size_t(bits), 8));
  std::vector<float> rotated(spec_.rotate ? block : 0);
  for (size_t b = 0; b < blocks; ++b) {
    const size_t first = b * block, last = std::min(n, first + block);
    const bool rotate = rotates(last - first);
    if (rotate) rotate_block(x + first, first, block, rotated.data());
    auto value = [&](size_t i) { return rotate ? rotated[i - first] : x[i]; };
    float peak = 0;
    bool finite = true;
    for (size_t i = first; i < last; ++i) {
      peak = std::max(peak, std::fabs(value(i)));
      finite = finite && std::isfinite(value(i));
    }
    if (!finite) {
      // A block holding NaN or infinity has no scale: its NaN scale makes
      // every receiver refuse the message instead of reading zeros.
      put16(out + 2 * b, 0x7fc0);
      for (size_t i = first; i < last; ++i) put_code(codes, i, bits, unsigned(qmax + 1));
      continue;
    }
    const uint16_t scale_bits = to_bf16_up(peak / float(qmax));
    put16(out + 2 * b, scale_bits);
    const float scale = from_bf16(scale_bits);
    const float inverse = scale > 0 ? 1.0f / scale : 0.0f;
    for (size_t i = first; i < last; ++i) {
      const float u = value(i) * inverse;
      float q = spec_.stochastic ? std::floor(u + uniform(seed, i)) : std::nearbyint(u);
      q = std::min(float(qmax), std::max(float(-qmax), q));
      put_code(codes, i, bits, unsigned(int(q) + qmax + 1));
    }
  }
}

namespace {

// A diverged or hostile peer's NaN would otherwise pass into our weights.
void refuse_non_finite(const float* values, size_t n) {
  for (size_t i = 0; i < n; ++i)
    if (!std::isfinite(values[i])) malformed(fmt::format("value {} is {}", i, values[i]));
}

}  // namespace

void WireCodec::decode_dense(const uint8_t* in, size_t n, float* out) const {
  switch (spec_.type) {
    case CodecSpec::Type::fp32:
      for (size_t i = 0; i < n; ++i) std::memcpy(&out[i], in + 4 * i, 4);
      return refuse_non_finite(out, n);
    case CodecSpec::Type::bf16:
      for (size_t i = 0; i < n; ++i) out[i] = from_bf16(get16(in + 2 * i));
      return refuse_non_finite(out, n);
    default: break;
  }
  const int bits = bits_of_type(spec_.type), qmax = (1 << (bits - 1)) - 1;
  const size_t block = size_t(spec_.block), blocks = ceil_div(n, block);
  const uint8_t* codes = in + size_t(described(spec_.type).block_bytes) * blocks;
  const size_t code_bits = n * size_t(bits);
  if (code_bits % 8 != 0 && (codes[code_bits / 8] >> (code_bits % 8)) != 0)
    malformed(fmt::format("{} padding is not zero", codec_type_name(spec_.type)));
  if (spec_.type == CodecSpec::Type::bins2) return decode_bins(in, n, out);
  for (size_t b = 0; b < blocks; ++b) {
    const float scale = from_bf16(get16(in + 2 * b));
    // The encoder's scales keep every code finite: a larger one would decode past the float range.
    if (!std::isfinite(scale * float(qmax)) || scale < 0) malformed(fmt::format("block {} has scale {}", b, scale));
    const size_t first = b * block, last = std::min(n, first + block);
    for (size_t i = first; i < last; ++i) {
      const unsigned code = get_code(codes, i, bits);
      if (code == 0) malformed(fmt::format("{} code {}", codec_type_name(spec_.type), -(qmax + 1)));
      out[i] = float(int(code) - qmax - 1) * scale;
    }
    if (rotates(last - first)) unrotate_block(out + first, first, block);
  }
}

// Codes: bit 0 the sign (1: negative), bit 1 the upper bin.
void WireCodec::encode_bins(const float* x, size_t n, uint8_t* out) const {
  const size_t block = size_t(spec_.block), blocks = ceil_div(n, block);
  uint8_t* codes = out + 4 * blocks;
  std::memset(codes, 0, ceil_div(2 * n, 8));
  for (size_t b = 0; b < blocks; ++b) {
    const size_t first = b * block, last = std::min(n, first + block);
    if (!std::all_of(x + first, x + last, [](float v) { return std::isfinite(v); })) {
      put16(out + 4 * b, 0x7fc0);  // a NaN mean: every receiver refuses the message
      continue;
    }
    const auto bins = two_bins(x + first, last - first);
    put16(out + 4 * b, to_bf16(bins.low));
    put16(out + 4 * b + 2, to_bf16(bins.high));
    for (size_t i = first; i < last; ++i)
      put_code(codes, i, 2, (std::fabs(x[i]) > bins.split ? 2u : 0u) | (x[i] < 0 ? 1u : 0u));
  }
}

void WireCodec::decode_bins(const uint8_t* in, size_t n, float* out) const {
  const size_t block = size_t(spec_.block), blocks = ceil_div(n, block);
  const uint8_t* codes = in + 4 * blocks;
  for (size_t b = 0; b < blocks; ++b) {
    const float low = from_bf16(get16(in + 4 * b)), high = from_bf16(get16(in + 4 * b + 2));
    if (!(std::isfinite(low) && std::isfinite(high) && low >= 0 && high >= low))
      malformed(fmt::format("block {} has bin means {} and {}", b, low, high));
    const size_t first = b * block, last = std::min(n, first + block);
    for (size_t i = first; i < last; ++i) {
      const unsigned code = get_code(codes, i, 2);
      const float magnitude = (code & 2u) ? high : low;
      out[i] = (code & 1u) ? -magnitude : magnitude;
    }
  }
}

void WireCodec::encode(const float* x, size_t n, uint8_t* out, uint64_t seed) const {
  if (spec_.topk == 0) return encode_dense(x, n, out, seed);
  std::memset(out, 0, encoded_bytes(n));
  std::vector<float> values;
  std::vector<uint32_t> order;
  size_t at = 0;
  for (size_t first = 0; first < n; first += kChunk) {
    const size_t len = std::min(kChunk, n - first), k = chunk_k(len);
    order.resize(len);
    std::iota(order.begin(), order.end(), 0u);
    // The k largest magnitudes; ties go to the earlier position, so the choice is deterministic.
    auto larger = [&](uint32_t a, uint32_t b) {
      const float fa = std::fabs(x[first + a]), fb = std::fabs(x[first + b]);
      return fa > fb || (fa == fb && a < b);
    };
    std::nth_element(order.begin(), order.begin() + long(k) - 1, order.end(), larger);
    std::sort(order.begin(), order.begin() + long(k));
    for (size_t j = 0; j < k; ++j) values.push_back(x[first + order[j]]);
    write_positions(order.data(), len, k, out, at);
    at += position_bits(len, k);
  }
  encode_dense(values.data(), values.size(), out + ceil_div(at, 8), seed);
}

void WireCodec::decode(const uint8_t* in, size_t bytes, size_t n, float* out) const {
  if (bytes != encoded_bytes(n))
    malformed(fmt::format("{} bytes where {} values of {} take {}", bytes, n, describe(), encoded_bytes(n)));
  if (spec_.topk == 0) return decode_dense(in, n, out);
  const auto size = topk_size(n);
  for (size_t bit = size.position_bits; bit % 8 != 0; ++bit)
    if (get_bit(in, bit)) malformed("position padding is not zero");
  std::vector<float> values(size.values);
  decode_dense(in + ceil_div(size.position_bits, 8), size.values, values.data());
  std::fill(out, out + n, 0.0f);
  std::vector<uint32_t> positions;
  size_t j = 0, at = 0;
  for (size_t first = 0; first < n; first += kChunk) {
    const size_t len = std::min(kChunk, n - first), k = chunk_k(len);
    positions.resize(k);
    read_positions(in, at, len, k, positions.data());
    at += position_bits(len, k);
    for (size_t e = 0; e < k; ++e) out[first + positions[e]] = values[j++];
  }
}

}  // namespace noloco
