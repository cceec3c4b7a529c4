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

int bits_of_type(CodecSpec::Type t) { return described(t).integer_bits; }

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

}  // namespace

bool integer_code(CodecSpec::Type type) { return bits_of_type(type) > 0; }

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
  switch (spec_.type) {
    case CodecSpec::Type::fp32: return 4 * n;
    case CodecSpec::Type::bf16: return 2 * n;
    default: return 2 * ceil_div(n, size_t(spec_.block)) + ceil_div(n * size_t(bits_of_type(spec_.type)), 8);
  }
}

size_t WireCodec::encoded_bytes(size_t n) const {
  if (spec_.topk == 0) return dense_bytes(n);
  size_t k = 0;
  for (size_t first = 0; first < n; first += kChunk) k += chunk_k(std::min(kChunk, n - first));
  return ceil_div(12 * k, 8) + dense_bytes(k);
}

int64_t WireCodec::format_id() const {
  return (int64_t(spec_.type) + 1) | (spec_.rotate ? 0x80 : 0) | (spec_.block << 8) |
         (int64_t(std::llround(spec_.topk * 1e6)) << 24);
}

std::string WireCodec::describe() const {
  std::string s = codec_type_name(spec_.type);
  if (integer_code(spec_.type))
    s += fmt::format(" ({}-value blocks{}{})", spec_.block, spec_.rotate ? ", rotated" : "",
                     spec_.stochastic ? ", stochastic rounding" : "");
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

void WireCodec::decode_dense(const uint8_t* in, size_t n, float* out) const {
  switch (spec_.type) {
    case CodecSpec::Type::fp32:
      for (size_t i = 0; i < n; ++i) std::memcpy(&out[i], in + 4 * i, 4);
      return;
    case CodecSpec::Type::bf16:
      for (size_t i = 0; i < n; ++i) out[i] = from_bf16(get16(in + 2 * i));
      return;
    default: break;
  }
  const int bits = bits_of_type(spec_.type), qmax = (1 << (bits - 1)) - 1;
  const size_t block = size_t(spec_.block), blocks = ceil_div(n, block);
  const uint8_t* codes = in + 2 * blocks;
  const size_t code_bits = n * size_t(bits);
  if (code_bits % 8 != 0 && (codes[code_bits / 8] >> (code_bits % 8)) != 0)
    malformed(fmt::format("{} padding is not zero", codec_type_name(spec_.type)));
  for (size_t b = 0; b < blocks; ++b) {
    const float scale = from_bf16(get16(in + 2 * b));
    if (!std::isfinite(scale) || scale < 0) malformed(fmt::format("block {} has scale {}", b, scale));
    const size_t first = b * block, last = std::min(n, first + block);
    for (size_t i = first; i < last; ++i) {
      const unsigned code = get_code(codes, i, bits);
      if (code == 0) malformed(fmt::format("{} code {}", codec_type_name(spec_.type), -(qmax + 1)));
      out[i] = float(int(code) - qmax - 1) * scale;
    }
    if (rotates(last - first)) unrotate_block(out + first, first, block);
  }
}

void WireCodec::encode(const float* x, size_t n, uint8_t* out, uint64_t seed) const {
  if (spec_.topk == 0) return encode_dense(x, n, out, seed);
  std::vector<uint32_t> positions;
  std::vector<float> values;
  std::vector<uint32_t> order;
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
    for (size_t j = 0; j < k; ++j) {
      positions.push_back(order[j]);
      values.push_back(x[first + order[j]]);
    }
  }
  const size_t position_bytes = ceil_div(12 * positions.size(), 8);
  std::memset(out, 0, position_bytes);
  for (size_t j = 0; j < positions.size(); ++j) {
    const size_t bit = 12 * j;
    const uint32_t p = positions[j] << (bit % 8);
    out[bit / 8] |= uint8_t(p & 0xff);
    out[bit / 8 + 1] |= uint8_t((p >> 8) & 0xff);
  }
  encode_dense(values.data(), values.size(), out + position_bytes, seed);
}

void WireCodec::decode(const uint8_t* in, size_t bytes, size_t n, float* out) const {
  if (bytes != encoded_bytes(n))
    malformed(fmt::format("{} bytes where {} values of {} take {}", bytes, n, describe(), encoded_bytes(n)));
  if (spec_.topk == 0) return decode_dense(in, n, out);
  size_t total = 0;
  for (size_t first = 0; first < n; first += kChunk) total += chunk_k(std::min(kChunk, n - first));
  const size_t position_bytes = ceil_div(12 * total, 8);
  std::vector<float> values(total);
  decode_dense(in + position_bytes, total, values.data());
  std::fill(out, out + n, 0.0f);
  size_t j = 0;
  for (size_t first = 0; first < n; first += kChunk) {
    const size_t len = std::min(kChunk, n - first), k = chunk_k(len);
    int64_t previous = -1;
    for (size_t e = 0; e < k; ++e, ++j) {
      const size_t bit = 12 * j;
      const uint32_t p = ((uint32_t(in[bit / 8]) | (uint32_t(in[bit / 8 + 1]) << 8)) >> (bit % 8)) & 0xfffu;
      if (int64_t(p) <= previous || p >= len)
        malformed(fmt::format("position {} after {} in a chunk of {}", p, previous, len));
      previous = p;
      out[first + p] = values[j];
    }
  }
  if (12 * total % 8 != 0 && (in[position_bytes - 1] >> 4) != 0) malformed("position padding is not zero");
}

}  // namespace noloco
