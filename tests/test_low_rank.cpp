// Low-rank outer messages (optim/low_rank.h): which values travel as
// factors, how close the factors come to the best rank-r approximation, that
// the rest travels exactly, and that a peer's malformed message is refused.
#include <gtest/gtest.h>

#include <random>

#include "optim/channels.h"
#include "optim/low_rank.h"

using namespace noloco;

namespace {

// A 40 × 30 matrix, a vector, a 3 × 3 matrix (rank-2 factors would be larger
// than it) and a 4 × 5 × 6 tensor (a 4 × 30 matrix).
struct Shapes : torch::nn::Module {
  Shapes() {
    big = register_parameter("big", torch::zeros({40, 30}));
    norm = register_parameter("norm", torch::zeros({30}));
    tiny = register_parameter("tiny", torch::zeros({3, 3}));
    cube = register_parameter("cube", torch::zeros({4, 5, 6}));
  }
  torch::Tensor big, norm, tiny, cube;
};

// A matrix of rank `rank` whose k-th direction weighs 0.8^k (an increment's
// spectrum decays), plus `noise` times Gaussian noise.
torch::Tensor low_rank_matrix(int64_t rows, int64_t cols, int64_t rank, double noise, uint64_t seed) {
  torch::manual_seed(seed);
  const auto weights = torch::pow(0.8, torch::arange(rank, torch::kFloat32));
  return (torch::randn({rows, rank}) * weights).mm(torch::randn({rank, cols})) + noise * torch::randn({rows, cols});
}

// The share of |m|² the best rank-r approximation holds (Eckart-Young).
double best_share(const torch::Tensor& m, int64_t r) {
  const auto s = std::get<1>(at::linalg_svd(m, false)).pow(2);
  return (s.narrow(0, 0, r).sum() / s.sum()).item<double>();
}

double share(const torch::Tensor& part, const torch::Tensor& whole) {
  return 1.0 - ((whole - part).pow(2).sum() / whole.pow(2).sum()).item<double>();
}

}  // namespace

TEST(LowRank, MatricesTravelAsFactorsAndEverythingElseAsItIs) {
  Shapes m;
  FlatParams flat{m};
  const int64_t n = flat.numel();
  const LowRankCoding coding(flat, 0, n, 2);
  EXPECT_EQ(coding.matrices(), 2);  // big and cube; tiny is not worth it
  EXPECT_EQ(coding.coded_values(), (40 + 30) * 2 + 30 + 9 + (4 + 30) * 2);

  torch::manual_seed(1);
  auto x = torch::randn({n});
  x.narrow(0, 0, 1200).copy_(low_rank_matrix(40, 30, 6, 1.0, 1).reshape({-1}));
  const auto y = coding.expand(coding.factor(x, 7));
  // The vector and the tiny matrix arrive bit for bit.
  const int64_t norm_at = 40 * 30, tiny_at = norm_at + 30;
  EXPECT_TRUE(torch::equal(y.narrow(0, norm_at, 30 + 9), x.narrow(0, norm_at, 30 + 9)));
  // Each matrix arrives as (nearly) its best rank-2 approximation: never more
  // than it holds, and within a percent of it.
  const auto big = x.narrow(0, 0, 1200).view({40, 30}), big_sent = y.narrow(0, 0, 1200).view({40, 30});
  EXPECT_LE(share(big_sent, big), best_share(big, 2) + 1e-5);
  EXPECT_GT(share(big_sent, big), best_share(big, 2) - 0.01);
  const int64_t cube_at = tiny_at + 9;
  const auto cube = x.narrow(0, cube_at, 120).view({4, 30}), cube_sent = y.narrow(0, cube_at, 120).view({4, 30});
  EXPECT_GT(share(cube_sent, cube), best_share(cube, 2) - 0.01);
}

TEST(LowRank, ALowRankIncrementTravelsWholeAndTheSeedOnlyPicksTheSketch) {
  struct One : torch::nn::Module {
    One() { w = register_parameter("w", torch::zeros({64, 48})); }
    torch::Tensor w;
  } m;
  FlatParams flat{m};
  const LowRankCoding coding(flat, 0, flat.numel(), 3);
  const auto x = low_rank_matrix(64, 48, 3, 0, 2).reshape({-1});
  const auto y = coding.expand(coding.factor(x, 11));
  EXPECT_LT(((y - x).norm() / x.norm()).item<double>(), 1e-5);
  // The same seed gives the same factors; another seed the same matrix.
  EXPECT_TRUE(torch::equal(coding.factor(x, 11), coding.factor(x, 11)));
  EXPECT_LT(((coding.expand(coding.factor(x, 12)) - y).norm() / x.norm()).item<double>(), 1e-5);
}

// The randomized SVD comes within a percent of the exact truncated SVD on a
// noisy low-rank matrix of the demo MLP's shape.
TEST(LowRank, FactorsHoldNearlyTheBestRankRShare) {
  struct One : torch::nn::Module {
    One() { w = register_parameter("w", torch::zeros({128, 344})); }
    torch::Tensor w;
  } m;
  FlatParams flat{m};
  for (int64_t r : {1, 2, 4, 8}) {
    const LowRankCoding coding(flat, 0, flat.numel(), r);
    const auto x = low_rank_matrix(128, 344, 16, 2.0, uint64_t(r));
    const auto y = coding.expand(coding.factor(x.reshape({-1}), 3)).view({128, 344});
    const double best = best_share(x, r);
    EXPECT_GT(share(y, x), best - 0.01) << "rank " << r << ": best " << best;
  }
}

// A fragment boundary cuts matrices: only whole rows inside it are factored,
// the cut rows travel as they are.
TEST(LowRank, AFragmentFactorsTheWholeRowsInsideIt) {
  Shapes m;
  FlatParams flat{m};
  const int64_t offset = 45, numel = 1200 - 45 + 30 + 9 + 61;  // from big's row 1 (+15) into cube's row 2 (+1)
  const LowRankCoding coding(flat, offset, numel, 2);
  // big: rows 2-39 (38 × 30); cube: rows 0-1 (2 × 30: rank-2 factors are not smaller).
  EXPECT_EQ(coding.matrices(), 1);
  EXPECT_EQ(coding.coded_values(), numel - 38 * 30 + (38 + 30) * 2);
  torch::manual_seed(3);
  const auto x = torch::randn({numel});
  const auto y = coding.expand(coding.factor(x, 1));
  EXPECT_TRUE(torch::equal(y.narrow(0, 0, 15), x.narrow(0, 0, 15)));  // big's cut row 1
  const int64_t after = 15 + 38 * 30;
  EXPECT_TRUE(torch::equal(y.narrow(0, after, numel - after), x.narrow(0, after, numel - after)));
  EXPECT_FALSE(torch::equal(y.narrow(0, 15, 38 * 30), x.narrow(0, 15, 38 * 30)));
}

// A peer's bytes through an int8 channel with low-rank factors: random and
// mutated messages either decode to finite values or are refused in one line.
TEST(LowRank, MalformedMessagesAreRefusedInOneLine) {
  Shapes m;
  FlatParams flat{m};
  CodecSpec spec;
  spec.type = CodecSpec::Type::int8;
  const WireCodec codec(spec);
  const auto coding = low_rank_coding(flat, 0, flat.numel(), 2);
  ErrorFeedbackChannel channel(codec, {1, ResidualHome::message}, flat.numel(), "residual", coding);
  torch::manual_seed(4);
  std::vector<uint8_t> valid(size_t(channel.bytes()));
  channel.encode(torch::randn({flat.numel()}), valid.data(), 5);
  EXPECT_TRUE(torch::isfinite(channel.decode(valid.data())).all().item<bool>());

  std::mt19937 rng(6);
  int refused = 0, decoded = 0;
  for (int trial = 0; trial < 2000; ++trial) {
    auto bytes = valid;
    if (trial % 2 == 0) {
      for (auto& b : bytes) b = uint8_t(rng());
    } else {
      for (int k = 0; k < 4; ++k) bytes[rng() % bytes.size()] = uint8_t(rng());
    }
    try {
      const auto out = channel.decode(bytes.data());
      ASSERT_TRUE(torch::isfinite(out).all().item<bool>()) << trial;
      ++decoded;
    } catch (const std::runtime_error& e) {
      const std::string what = e.what();
      ASSERT_FALSE(what.empty());
      ASSERT_EQ(what.find('\n'), std::string::npos) << what;
      ++refused;
    }
  }
  EXPECT_GT(refused, 0);
  EXPECT_GT(decoded, 0);

  // Every block's scale 2^99 (bf16 0x7100; the scales lead the message):
  // finite values, whose products pass the float range.
  const size_t blocks = size_t(coding->coded_values() + 63) / 64;
  auto huge = valid;
  for (size_t b = 0; b < blocks; ++b) huge[2 * b] = 0x00, huge[2 * b + 1] = 0x71;
  try {
    channel.decode(huge.data());
    ADD_FAILURE() << "a product past the float range decoded";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("beyond the float range"), std::string::npos) << e.what();
  }
}
