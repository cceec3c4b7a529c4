// Wire codecs, coset coding and error feedback: round trips within stated
// bounds, exact byte counts, unbiased stochastic rounding, and a decoder
// that refuses malformed bytes from a peer.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include <torch/torch.h>

#include "wire/codec.h"
#include "wire/coset_codec.h"
#include "optim/channels.h"

using namespace noloco;

namespace {

std::vector<float> normal_values(size_t n, float stddev, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d(0.0f, stddev);
  std::vector<float> x(n);
  for (auto& v : x) v = d(rng);
  return x;
}

std::vector<float> round_trip(const WireCodec& c, const std::vector<float>& x, uint64_t seed = 1) {
  std::vector<uint8_t> bytes(c.encoded_bytes(x.size()));
  c.encode(x.data(), x.size(), bytes.data(), seed);
  std::vector<float> y(x.size());
  c.decode(bytes.data(), bytes.size(), x.size(), y.data());
  return y;
}

CodecSpec spec(CodecSpec::Type type, double topk = 0, bool stochastic = false, bool rotate = false) {
  CodecSpec s;
  s.type = type;
  s.topk = topk;
  s.stochastic = stochastic;
  s.rotate = rotate;
  return s;
}

constexpr CodecSpec::Type kIntegerTypes[] = {CodecSpec::Type::int8, CodecSpec::Type::int4, CodecSpec::Type::int3,
                                             CodecSpec::Type::int2};
int qmax_of(CodecSpec::Type type) {
  switch (type) {
    case CodecSpec::Type::int8: return 127;
    case CodecSpec::Type::int4: return 7;
    case CodecSpec::Type::int3: return 3;
    default: return 1;
  }
}

std::string decode_error(const WireCodec& c, std::vector<uint8_t> bytes, size_t n) {
  std::vector<float> y(n);
  try {
    c.decode(bytes.data(), bytes.size(), n, y.data());
  } catch (const std::runtime_error& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST(Codec, ByteCountsAreExactAndKnownFromTheLengthAlone) {
  const size_t n = 1000;  // 15 full blocks of 64 and one of 40
  EXPECT_EQ(WireCodec(spec(CodecSpec::Type::fp32)).encoded_bytes(n), 4000u);
  EXPECT_EQ(WireCodec(spec(CodecSpec::Type::bf16)).encoded_bytes(n), 2000u);
  EXPECT_EQ(WireCodec(spec(CodecSpec::Type::int8)).encoded_bytes(n), 16u * 2 + 1000);
  EXPECT_EQ(WireCodec(spec(CodecSpec::Type::int4)).encoded_bytes(n), 16u * 2 + 500);
  EXPECT_EQ(WireCodec(spec(CodecSpec::Type::int4)).encoded_bytes(1001), 16u * 2 + 501);
  EXPECT_EQ(WireCodec(spec(CodecSpec::Type::int3)).encoded_bytes(n), 16u * 2 + 375);
  EXPECT_EQ(WireCodec(spec(CodecSpec::Type::int3)).encoded_bytes(1001), 16u * 2 + 376);  // 3003 bits
  EXPECT_EQ(WireCodec(spec(CodecSpec::Type::int2)).encoded_bytes(n), 16u * 2 + 250);
  EXPECT_EQ(WireCodec(spec(CodecSpec::Type::int2, 0, false, true)).encoded_bytes(n), 16u * 2 + 250);
  EXPECT_EQ(WireCodec(spec(CodecSpec::Type::bins2)).encoded_bytes(n), 16u * 4 + 250);  // two bf16 means a block
  // Top 1% of a 4096-value chunk and of a 904-value remainder: 41 and 10
  // Rice-coded positions, each chunk in its bound k(r + 1) + ((len - k) >> r)
  // at the best r (6 for both: 287 + 63 and 70 + 14 bits), then int4 values.
  const WireCodec top(spec(CodecSpec::Type::int4, 0.01));
  EXPECT_EQ(top.encoded_bytes(5000), size_t((350 + 84 + 7) / 8 + 2 * 1 + (51 + 1) / 2));
  // 64 of 4096, the SparseLoCo density: 510 bits, 8.0 a position.
  EXPECT_EQ(WireCodec(spec(CodecSpec::Type::fp32, 64.0 / 4096)).encoded_bytes(4096), size_t(510 / 8 + 1 + 4 * 64));
  for (const auto& row : kCodecTypes) {
    const WireCodec c(spec(row.type, 0.05));
    const auto x = normal_values(n, 1.0f, 3);
    std::vector<uint8_t> bytes(c.encoded_bytes(n));
    c.encode(x.data(), n, bytes.data(), 7);  // writes exactly that many (ASan would see more)
    EXPECT_EQ(decode_error(c, bytes, n), "");
  }
}

TEST(Codec, Fp32IsExactAndBf16MatchesLibTorch) {
  const auto x = normal_values(777, 0.02f, 1);
  EXPECT_EQ(round_trip(WireCodec(spec(CodecSpec::Type::fp32)), x), x);
  const auto y = round_trip(WireCodec(spec(CodecSpec::Type::bf16)), x);
  const auto expected = torch::tensor(x).to(torch::kBFloat16).to(torch::kFloat32);
  for (size_t i = 0; i < x.size(); ++i) ASSERT_EQ(y[i], expected[long(i)].item<float>()) << i;
}

TEST(Codec, IntegerCodesStayWithinHalfAScale) {
  for (auto type : kIntegerTypes) {
    const int qmax = qmax_of(type);
    auto x = normal_values(1001, 0.01f, 2);  // odd: int4 and int3 end inside a byte
    x[5] = 0.5f;  // one outlier: its block's scale grows, the others' do not
    const auto y = round_trip(WireCodec(spec(type)), x);
    for (size_t b = 0; b * 64 < x.size(); ++b) {
      float peak = 0;
      for (size_t i = b * 64; i < std::min(x.size(), b * 64 + 64); ++i) peak = std::max(peak, std::fabs(x[i]));
      const float scale = peak / float(qmax) * (1 + 1.0f / 128);  // bf16 rounds the scale up by < 2^-7
      for (size_t i = b * 64; i < std::min(x.size(), b * 64 + 64); ++i)
        ASSERT_LE(std::fabs(y[i] - x[i]), scale / 2 * 1.0001f) << codec_type_name(type) << " element " << i;
    }
  }
  const std::vector<float> zeros(100, 0.0f);
  for (auto type : kIntegerTypes) EXPECT_EQ(round_trip(WireCodec(spec(type)), zeros), zeros);
}

// The rotation is orthogonal: a block's error in the rotated coordinates,
// at most half a scale a value, is its error after rotating back (in the
// L2 norm). Where a few channels carry outliers, as hidden states do, it
// spreads them, the scale falls, and with 7 or more levels a side the error
// with it (int3 and int2 round the spread values too coarsely to gain here).
TEST(Codec, RotatedBlocksKeepTheL2BoundAndShrinkTheErrorOfOutliers) {
  const size_t n = 64 * 40 + 10;  // 40 whole blocks (rotated) and a short one (as it is)
  auto x = normal_values(n, 1.0f, 11);
  for (size_t i = 3; i < n; i += 64) x[i] *= 30;  // one outlier channel in every block
  for (auto type : kIntegerTypes) {
    const WireCodec plain(spec(type)), rotated(spec(type, 0, false, true));
    const auto y = round_trip(rotated, x), z = round_trip(plain, x);
    double rotated_error = 0, plain_error = 0;
    for (size_t b = 0; b * 64 < n; ++b) {
      const size_t first = b * 64, last = std::min(n, first + 64);
      double energy = 0, error = 0;
      for (size_t i = first; i < last; ++i) {
        energy += double(x[i]) * x[i];
        error += double(y[i] - x[i]) * (y[i] - x[i]);
        plain_error += double(z[i] - x[i]) * (z[i] - x[i]);
      }
      rotated_error += error;
      // The rotated peak is at most the block's L2 norm, so the scale is at most norm/qmax.
      const double scale = std::sqrt(energy) / qmax_of(type) * (1 + 1.0 / 128);
      EXPECT_LE(std::sqrt(error), std::sqrt(double(last - first)) * scale / 2 * 1.0001)
          << codec_type_name(type) << " block " << b;
    }
    if (qmax_of(type) >= 7) EXPECT_LT(rotated_error, 0.5 * plain_error) << codec_type_name(type);
    EXPECT_NE(WireCodec(spec(type)).format_id(), rotated.format_id()) << "peers must agree on the rotation";
  }
  EXPECT_THROW(WireCodec(spec(CodecSpec::Type::bf16, 0, false, true)), std::invalid_argument);
  EXPECT_THROW(WireCodec(spec(CodecSpec::Type::int4, 0.1, false, true)), std::invalid_argument);
  auto odd_block = spec(CodecSpec::Type::int4, 0, false, true);
  odd_block.block = 96;
  EXPECT_THROW(WireCodec{odd_block}, std::invalid_argument);
}

TEST(Codec, StochasticRoundingIsUnbiasedAndDeterministicPerSeed) {
  for (bool rotate : {false, true}) {
    SCOPED_TRACE(rotate ? "rotated" : "as it is");
    const WireCodec c(spec(CodecSpec::Type::int4, 0, /*stochastic=*/true, rotate));
    auto x = normal_values(64, 1.0f, 4);
    std::vector<double> mean(x.size(), 0.0);
    const int draws = 4000;
    for (int s = 0; s < draws; ++s) {
      const auto y = round_trip(c, x, uint64_t(s));
      for (size_t i = 0; i < x.size(); ++i) mean[i] += y[i] / draws;
    }
    double energy = 0, peak = 0;
    for (float v : x) energy += double(v) * v, peak = std::max(peak, double(std::fabs(v)));
    const double scale = (rotate ? std::sqrt(energy) : peak) / 7.0;  // a rotated block's peak is at most its norm
    // Each draw is off by at most one scale a (rotated) value; the mean of 4000 by about scale/sqrt(4000)/2.
    for (size_t i = 0; i < x.size(); ++i) EXPECT_NEAR(mean[i], x[i], 4 * scale / std::sqrt(draws)) << i;
    EXPECT_EQ(round_trip(c, x, 9), round_trip(c, x, 9));
    EXPECT_NE(round_trip(c, x, 9), round_trip(c, x, 10));
  }
}

TEST(Codec, TopKSendsTheLargestOfEachChunkAndZeroesTheRest) {
  const WireCodec c(spec(CodecSpec::Type::fp32, 0.01));
  auto x = normal_values(5000, 1.0f, 5);
  const auto y = round_trip(c, x);
  for (size_t first = 0; first < x.size(); first += WireCodec::kChunk) {
    const size_t len = std::min(WireCodec::kChunk, x.size() - first), k = size_t(std::ceil(0.01 * double(len)));
    std::vector<float> magnitudes;
    for (size_t i = first; i < first + len; ++i) magnitudes.push_back(std::fabs(x[i]));
    std::sort(magnitudes.rbegin(), magnitudes.rend());
    size_t sent = 0;
    for (size_t i = first; i < first + len; ++i) {
      if (y[i] == 0) continue;
      ++sent;
      EXPECT_EQ(y[i], x[i]);  // fp32 values travel exactly
      EXPECT_GE(std::fabs(x[i]), magnitudes[k - 1]);
    }
    EXPECT_EQ(sent, k);
  }
}

TEST(Codec, DecoderRefusesMalformedBytes) {
  const size_t n = 100;
  const auto x = normal_values(n, 1.0f, 6);
  auto encoded = [&](const WireCodec& c) {
    std::vector<uint8_t> b(c.encoded_bytes(n));
    c.encode(x.data(), n, b.data(), 1);
    return b;
  };
  const WireCodec int8(spec(CodecSpec::Type::int8)), int4(spec(CodecSpec::Type::int4)),
      top(spec(CodecSpec::Type::int8, 0.1));
  auto b = encoded(int8);
  b.pop_back();
  EXPECT_NE(decode_error(int8, b, n).find("bytes where 100 values"), std::string::npos);
  b = encoded(int8);
  b[0] = 0xff, b[1] = 0x7f;  // a NaN scale
  EXPECT_NE(decode_error(int8, b, n).find("block 0 has scale"), std::string::npos);
  const WireCodec fp32(spec(CodecSpec::Type::fp32)), bf16(spec(CodecSpec::Type::bf16));
  b = encoded(fp32);
  b[4 * 3 + 2] = 0x80, b[4 * 3 + 3] = 0x7f;  // value 3: exponent all ones, an infinity or NaN
  EXPECT_NE(decode_error(fp32, b, n).find("value 3 is"), std::string::npos);
  b = encoded(bf16);
  b[2 * 5] = 0xc0, b[2 * 5 + 1] = 0x7f;  // value 5: a NaN
  EXPECT_NE(decode_error(bf16, b, n).find("value 5 is nan"), std::string::npos);
  b = encoded(int8);
  b[0] = 0x00, b[1] = 0x7f;  // 2^127: finite, but code 127 times it is not
  EXPECT_NE(decode_error(int8, b, n).find("block 0 has scale"), std::string::npos);
  b = encoded(int8);
  b[2 * 2 + 3] = 0x00;  // offset code 0 (-128), never written
  EXPECT_NE(decode_error(int8, b, n).find("int8 code -128"), std::string::npos);
  b = encoded(int4);
  b[2 * 2 + 1] &= 0xf0;  // nibble 0 (-8), never written
  EXPECT_NE(decode_error(int4, b, n).find("int4 code -8"), std::string::npos);
  const WireCodec int3(spec(CodecSpec::Type::int3)), int2(spec(CodecSpec::Type::int2));
  b = encoded(int3);
  b[2 * 2] &= 0xf8;  // the first 3-bit code 0 (-4), never written
  EXPECT_NE(decode_error(int3, b, n).find("int3 code -4"), std::string::npos);
  b = encoded(int3);
  b.back() |= 0x80;  // 300 bits of codes: the last byte's top 4 bits are padding
  EXPECT_NE(decode_error(int3, b, n).find("int3 padding is not zero"), std::string::npos);
  b = encoded(int2);
  b[2 * 2 + 7] &= 0x3f;  // code 0 (-2), never written
  EXPECT_NE(decode_error(int2, b, n).find("int2 code -2"), std::string::npos);
  b = encoded(top);
  std::fill(b.begin(), b.begin() + 6, 0xff);  // a unary quotient that never ends: all 51 position bits
  b[6] |= 0x07;                                 // ones (10 of 100 take 51 bits, see below)
  EXPECT_NE(decode_error(top, b, n).find("runs past its chunk"), std::string::npos);
  // 10 of 100: r = 3, 40 + 11 bits; gaps summing to 90 (the last position
  // 99) end at bit 40 + (90 >> 3) = 51, so a quotient one larger points past the chunk.
  std::vector<float> last_ten(n, 0.0f);
  for (size_t i = n - 10; i < n; ++i) last_ten[i] = 1.0f;
  b.assign(top.encoded_bytes(n), 0);
  top.encode(last_ten.data(), n, b.data(), 1);
  EXPECT_EQ(decode_error(top, b, n), "");
  auto extended = b;
  extended[1] |= 0x08;  // bit 11, the first quotient's end: 11 ones become 12
  EXPECT_NE(decode_error(top, extended, n), "");
  auto padded = b;
  padded[6] |= 0x80;  // bit 55: after the codes (51 bits), inside the chunk's 51 + padding to the byte
  EXPECT_NE(decode_error(top, padded, n).find("padding is not zero"), std::string::npos);
}

// The position code by hand: 4 of 16 values at positions 0, 1, 5, 15. The
// bound k(r + 1) + ((16 - 4) >> r) is smallest at r = 1 (14 bits); the gaps
// 0, 0, 3, 9 are written (quotient in unary, then the low bit, from bit 0
// up) 0 0 | 0 0 | 1 0 1 | 1 1 1 1 0 1, and bit 13 is padding.
TEST(Codec, TopKPositionsAreRiceCodedInAFixedBudgetPerChunk) {
  const WireCodec c(spec(CodecSpec::Type::fp32, 0.25));
  std::vector<float> x(16, 0.5f);
  x[0] = 4, x[1] = -3, x[5] = 2, x[15] = -6;
  ASSERT_EQ(c.encoded_bytes(16), 2u + 4 * 4);
  std::vector<uint8_t> b(c.encoded_bytes(16));
  c.encode(x.data(), 16, b.data(), 0);
  EXPECT_EQ(b[0], 0xd0);  // bits 4, 6, 7
  EXPECT_EQ(b[1], 0x17);  // bits 8, 9, 10, 12
  std::vector<float> y(16);
  c.decode(b.data(), b.size(), 16, y.data());
  for (size_t i = 0; i < 16; ++i) EXPECT_EQ(y[i], i == 0 || i == 1 || i == 5 || i == 15 ? x[i] : 0.0f) << i;
  // The extremes of the bound: every position at a chunk's end, or at its start, at several densities.
  for (double topk : {0.001, 0.0156, 0.1, 0.5, 0.99}) {
    const WireCodec top(spec(CodecSpec::Type::fp32, topk));
    for (bool at_end : {true, false}) {
      const size_t n = 4096 + 1000, k = size_t(std::ceil(topk * 4096));
      std::vector<float> v(n, 0.0f);
      for (size_t j = 0; j < k; ++j) v[at_end ? 4095 - j : j] = float(j + 1);
      EXPECT_EQ(round_trip(top, v), v) << topk << (at_end ? " at the end" : " at the start");
    }
  }
}

// By hand: one block of eight, magnitudes 1 and 3. Lloyd's split settles
// at 2, the means are exact in bf16, and the block comes back as it was.
TEST(Codec, BinMeansByHand) {
  CodecSpec s = spec(CodecSpec::Type::bins2);
  s.block = 8;
  const WireCodec c(s);
  const std::vector<float> x = {1, -1, 3, -3, 1, 1, 3, 3};
  ASSERT_EQ(c.encoded_bytes(8), 4u + 2);
  std::vector<uint8_t> b(6);
  c.encode(x.data(), 8, b.data(), 0);
  EXPECT_EQ(b[0], 0x80);  // bf16 1.0 = 0x3f80, little-endian
  EXPECT_EQ(b[1], 0x3f);
  EXPECT_EQ(b[2], 0x40);  // bf16 3.0 = 0x4040
  EXPECT_EQ(b[3], 0x40);
  EXPECT_EQ(b[4], 0xe4);  // codes 0, 1, 2, 3 (bit 0 the sign, bit 1 the upper bin)
  EXPECT_EQ(b[5], 0xa0);  // codes 0, 0, 2, 2
  EXPECT_EQ(round_trip(c, x), x);
}

// Every value keeps its sign and decodes to the mean magnitude of its bin,
// the larger magnitudes to the upper bin. On the values a top-k message
// sends (the largest 64 of 4096, none near zero) this is several times
// closer than int2, whose ternary rounds many of them to zero, in 2 bits a
// value and 2 more bytes a block.
TEST(Codec, BinMeansKeepEverySignAndTheOrderOfMagnitudes) {
  const WireCodec bins(spec(CodecSpec::Type::bins2));
  const auto x = normal_values(1000, 0.01f, 21);
  const auto y = round_trip(bins, x);
  auto magnitude_less = [](float a, float b) { return std::fabs(a) < std::fabs(b); };
  for (size_t first = 0; first < x.size(); first += 64) {
    const size_t last = std::min(x.size(), first + 64);
    for (size_t i = first; i < last; ++i) {
      ASSERT_EQ(std::signbit(y[i]), std::signbit(x[i])) << i;
      for (size_t j = first; j < last; ++j)
        if (std::fabs(x[i]) > std::fabs(x[j])) ASSERT_GE(std::fabs(y[i]), std::fabs(y[j])) << i << " " << j;
    }
    // Each bin's magnitudes sum to what was sent for them (bf16 rounds a mean by < 2^-8).
    const float low = std::fabs(*std::min_element(y.begin() + long(first), y.begin() + long(last), magnitude_less));
    const float high = std::fabs(*std::max_element(y.begin() + long(first), y.begin() + long(last), magnitude_less));
    ASSERT_LT(low, high);
    for (const float mean : {low, high}) {
      double sent = 0, decoded = 0;
      for (size_t i = first; i < last; ++i)
        if (std::fabs(y[i]) == mean) sent += std::fabs(x[i]), decoded += mean;
      EXPECT_NEAR(decoded, sent, sent / 256) << "block at " << first;
    }
  }
  // Both send the same 64 of the chunk; the error that differs is on those.
  const auto chunk = normal_values(4096, 0.01f, 22);
  const auto by_bins = round_trip(WireCodec(spec(CodecSpec::Type::bins2, 64.0 / 4096)), chunk);
  const auto by_int2 = round_trip(WireCodec(spec(CodecSpec::Type::int2, 64.0 / 4096)), chunk);
  double bins_error = 0, int2_error = 0;
  size_t sent = 0;
  for (size_t i = 0; i < chunk.size(); ++i) {
    if (by_bins[i] == 0) continue;
    ++sent;
    bins_error += std::pow(by_bins[i] - chunk[i], 2);
    int2_error += std::pow(by_int2[i] - chunk[i], 2);
  }
  EXPECT_EQ(sent, 64u);
  EXPECT_LT(bins_error * 3, int2_error);
}

TEST(Codec, BinMeansDecoderRefusesMeansNoEncoderWrites) {
  const WireCodec c(spec(CodecSpec::Type::bins2));
  const auto x = normal_values(99, 1.0f, 23);  // two blocks: means at bytes 0-3 and 4-7; 198 bits of codes
  std::vector<uint8_t> good(c.encoded_bytes(99));
  c.encode(x.data(), 99, good.data(), 0);
  ASSERT_EQ(decode_error(c, good, 99), "");
  auto b = good;
  b[5] = 0xbf;  // block 1's lower mean negative
  EXPECT_NE(decode_error(c, b, 99).find("block 1 has bin means -"), std::string::npos);
  b = good;
  b[2] = 0, b[3] = 0;  // block 0's upper mean 0, below its lower
  EXPECT_NE(decode_error(c, b, 99).find("block 0 has bin means"), std::string::npos);
  b = good;
  b.back() |= 0x80;  // the last two bits are padding
  EXPECT_NE(decode_error(c, b, 99).find("bins2 padding is not zero"), std::string::npos);
}

// Values that are not finite leave their block without a scale: the
// receiver refuses the message instead of reading zeros (max over NaN is 0).
TEST(Codec, ANonFiniteValueMakesItsBlockUndecodable) {
  for (auto type : kIntegerTypes) {
    for (bool rotate : {false, true}) {
      const WireCodec codec(spec(type, 0, false, rotate));
      const size_t n = 130;  // three blocks of 64, the last short
      for (float bad : {NAN, INFINITY}) {
        auto x = normal_values(n, 1.0f, 3);
        x[70] = bad;
        std::vector<uint8_t> b(codec.encoded_bytes(n));
        codec.encode(x.data(), n, b.data(), 1);
        EXPECT_NE(decode_error(codec, b, n).find("block 1 has scale nan"), std::string::npos) << codec_type_name(type);
      }
    }
  }
  const WireCodec bins(spec(CodecSpec::Type::bins2));
  auto x = normal_values(130, 1.0f, 3);
  x[70] = INFINITY;
  std::vector<uint8_t> b(bins.encoded_bytes(130));
  bins.encode(x.data(), 130, b.data(), 1);
  EXPECT_NE(decode_error(bins, b, 130).find("block 1 has bin means nan"), std::string::npos);
}

TEST(CosetCode, RecoversWithinTheRangeAndFlagsWhatFallsOutside) {
  const CosetCodec c(4, 64);
  const size_t n = 256;
  auto side = normal_values(n, 0.1f, 7);  // the receiver's own slow weights
  auto x = side;
  const auto noise = normal_values(n, 1e-3f, 8);
  for (size_t i = 0; i < n; ++i) x[i] += noise[i];
  std::vector<float> steps(c.blocks(n), 1e-3f);  // ±7 steps: ±7e-3, seven standard deviations
  x[200] = side[200] + 0.5f;                     // far outside block 3's range
  std::vector<uint8_t> bytes(c.encoded_bytes(n));
  EXPECT_EQ(bytes.size(), 4u * 4 + n / 2);
  c.encode(x.data(), n, steps.data(), bytes.data(), false, 0);
  std::vector<float> out(n);
  std::vector<uint8_t> failed;
  EXPECT_EQ(c.decode(bytes.data(), bytes.size(), n, side.data(), out.data(), &failed), 1u);
  EXPECT_EQ(failed, (std::vector<uint8_t>{0, 0, 0, 1}));
  const float step = c.step_of(bytes.data(), 0);
  EXPECT_GE(step, 1e-3f);
  EXPECT_LT(step, 1e-3f * 1.01f);
  for (size_t i = 0; i < 192; ++i) ASSERT_LE(std::fabs(out[i] - x[i]), step / 2 * 1.0001f) << i;  // |x| is 100x step
  for (size_t i = 192; i < n; ++i) ASSERT_EQ(out[i], side[i]) << "a failed block keeps the receiver's own";
}

TEST(CosetCode, RefusesMalformedSteps) {
  const CosetCodec c(3, 16);
  const std::vector<float> x(40, 0.25f), steps(3, 0.01f);
  std::vector<uint8_t> bytes(c.encoded_bytes(x.size()));
  c.encode(x.data(), x.size(), steps.data(), bytes.data(), false, 0);
  std::vector<float> out(x.size());
  auto bad = bytes;
  bad[0] = 0, bad[1] = 0;  // a zero step
  EXPECT_THROW(c.decode(bad.data(), bad.size(), x.size(), x.data(), out.data(), nullptr), std::runtime_error);
  EXPECT_THROW(c.decode(bytes.data(), bytes.size() - 1, x.size(), x.data(), out.data(), nullptr), std::runtime_error);
  EXPECT_EQ(c.decode(bytes.data(), bytes.size(), x.size(), x.data(), out.data(), nullptr), 0u);
}

// The grid a slow-weight channel picks, by hand (block 8: ±7 steps decode):
// max(3 × the expected disagreement, 6 × its own progress in the block) / 7,
// where the disagreement expected of a pair that last pulled together m φ
// exchanges ago is √(1 + m) times what was learned per unit of it.
TEST(CosetCode, SlowWeightGridCoversThreeTimesTheExpectedDisagreementAndSixTimesOwnProgress) {
  const CosetCodec codec(4, 8);
  SlowWeightChannel a(codec, 8, false, "phi_range"), b(codec, 8, false, "phi_range");
  std::vector<uint8_t> bytes(size_t(a.bytes()));
  const auto step_for = [&](SlowWeightChannel& channel, const torch::Tensor& phi, float progress, int64_t separation) {
    channel.encode(phi, torch::full({8}, progress), separation, bytes.data(), 0);
    return codec.step_of(bytes.data(), 0);
  };
  const auto phi_a = torch::full({8}, 0.3f);
  // Nothing decoded yet: the sender's own progress (peak 0.07) sets the grid, 6 × 0.07 / 7.
  const float step_a = step_for(a, phi_a, 0.07f, 3);
  EXPECT_NEAR(step_a, 0.06f, 0.0006f);
  // b's slow weights differ from a's by 0.2 in one place; a's grid covers ±0.42.
  auto phi_b = phi_a.clone();
  phi_b[0] = 0.5f;
  int64_t failed = 0;
  const auto decoded = b.decode(bytes.data(), phi_b, 3, &failed);
  EXPECT_EQ(failed, 0);
  EXPECT_NEAR(decoded[0].item<float>(), 0.3f, step_a / 2);
  // b learned a disagreement of |0.5 − 0.3| less half a step ≈ 0.17 from a
  // partner 3 exchanges apart: 0.17 / √4 per unit. With little progress of
  // its own (0.007), three times the expected disagreement sets its grid:
  // for a partner it pulled toward last time, 3 × 0.17 / 2 / 7; for one 2
  // exchanges apart (NoLoCo counts no further), √3 times that.
  const double per_unit = (0.5 - decoded[0].item<float>() - 0.5 * step_a) / 2;
  EXPECT_NEAR(step_for(b, phi_b, 0.007f, 0), 3 * per_unit / 7, 0.01 * 3 * per_unit / 7);
  EXPECT_NEAR(step_for(b, phi_b, 0.007f, 2), 3 * std::sqrt(3.0) * per_unit / 7,
              0.01 * 3 * std::sqrt(3.0) * per_unit / 7);
  // With more progress than that (peak 1), six times the progress does.
  EXPECT_NEAR(step_for(b, phi_b, 1.0f, 2), 6.0f / 7, 0.01f);
  // A partner that agrees exactly halves what b expects per unit, no more.
  b.decode(bytes.data(), phi_b, 0, &failed);
  EXPECT_NEAR(step_for(b, phi_b, 0.007f, 0), 1.5 * per_unit / 7, 0.01 * 1.5 * per_unit / 7);
}

// What error feedback promises: everything sent so far plus what is still
// owed equals everything that was to be sent.
TEST(ErrorFeedback, DelaysWhatTheCodecDropsInsteadOfLosingIt) {
  const WireCodec codec(spec(CodecSpec::Type::int4, 0.05));
  const int64_t n = 3000;
  ErrorFeedbackChannel channel(codec, Feedback{1.0}, n, "residual");
  auto owed = torch::zeros({n}), delivered = torch::zeros({n});
  std::vector<uint8_t> bytes(size_t(channel.bytes()));
  for (int t = 0; t < 20; ++t) {
    const auto x = torch::randn({n}) * 0.01;
    owed += x;
    channel.encode(x, bytes.data(), uint64_t(t));
    delivered += channel.decode(bytes.data());
  }
  TensorMap state;
  channel.save(state);
  const auto& residual = state.at("outer.residual");
  EXPECT_LT((owed - delivered - residual).abs().max().item<float>(), 1e-5);
  EXPECT_LT(residual.norm().item<float>(), 0.5 * owed.norm().item<float>());  // most of it has arrived
  // Without feedback the same codec loses the rest for good: nothing is kept.
  ErrorFeedbackChannel lossy(codec, Feedback{}, n, "residual");
  TensorMap none;
  lossy.save(none);
  EXPECT_TRUE(none.empty());
}

// A decaying feedback (SparseLoCo's e ← w·e + Δ), worked by hand on four
// values with top-1 fp32: each message carries the largest of w·e + Δ.
TEST(ErrorFeedback, DecayingFeedbackWeighsTheResidualBeforeAddingTheIncrement) {
  CodecSpec s;
  s.topk = 0.25;  // one value of the four
  const WireCodec codec(s);
  ErrorFeedbackChannel channel(codec, Feedback{0.5}, 4, "residual");
  std::vector<uint8_t> bytes(size_t(channel.bytes()));
  channel.encode(torch::tensor({4.0f, 3.0f, -2.0f, 1.0f}), bytes.data(), 0);
  // Sent 4 at position 0; e = (0, 3, -2, 1).
  EXPECT_TRUE(torch::equal(channel.decode(bytes.data()), torch::tensor({4.0f, 0.0f, 0.0f, 0.0f})));
  channel.encode(torch::tensor({0.0f, 0.0f, -2.5f, 0.0f}), bytes.data(), 1);
  // 0.5·e + Δ = (0, 1.5, -3.5, 0.5): sends -3.5 at position 2; e = (0, 1.5, 0, 0.5).
  EXPECT_TRUE(torch::equal(channel.decode(bytes.data()), torch::tensor({0.0f, 0.0f, -3.5f, 0.0f})));
  TensorMap state;
  channel.save(state);
  EXPECT_TRUE(torch::equal(state.at("outer.residual"), torch::tensor({0.0f, 1.5f, 0.0f, 0.5f})));
}
