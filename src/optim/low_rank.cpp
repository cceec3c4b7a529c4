#include "optim/low_rank.h"

#include <algorithm>
#include <stdexcept>

#include <fmt/format.h>

#include "util/splitmix.h"

namespace noloco {

namespace {

// Power iterations of the randomized SVD, and its sketch's columns a unit of
// rank: on the demo model's increments (rank 2, 4, 8) the part found holds
// within 0.2% of their energy of what the exact truncated SVD holds (with a
// sketch of 2r: 0.6%; without power iterations: 9-12% less).
constexpr int kPowerIterations = 2;
constexpr int64_t kSketchPerRank = 3;

// A rows × cols matrix of random signs: a sketch that is the same on every
// machine and LibTorch version for one seed.
torch::Tensor random_signs(int64_t rows, int64_t cols, uint64_t seed) {
  auto t = torch::empty({rows, cols}, torch::kFloat32);
  float* p = t.data_ptr<float>();
  uint64_t bits = 0;
  for (int64_t i = 0; i < rows * cols; ++i) {
    if (i % 64 == 0) bits = splitmix64(seed + uint64_t(i / 64));
    p[i] = (bits >> (i % 64)) & 1 ? 1.0f : -1.0f;
  }
  return t;
}

torch::Tensor orthonormal_columns(const torch::Tensor& y) { return std::get<0>(at::linalg_qr(y)); }

// Finite factors can still multiply past the float range.
void throw_unless_finite(const torch::Tensor& x) {
  if (!torch::isfinite(x).all().item<bool>())
    throw std::runtime_error("a low-rank message expands to values beyond the float range");
}

}  // namespace

LowRankCoding::LowRankCoding(const FlatParams& params, int64_t offset, int64_t numel, int64_t rank)
    : numel_(numel), rank_(rank) {
  if (rank < 1) throw std::invalid_argument(fmt::format("a low-rank message needs a rank >= 1, got {}", rank));
  const int64_t end = offset + numel;
  for (size_t i = 0; i < params.named().size(); ++i) {
    const auto& t = params.named()[i].second;
    if (t.dim() < 2) continue;
    const int64_t start = params.offset(i), cols = t.numel() / t.size(0);
    // The whole rows of this matrix inside the slice.
    const int64_t first_row = (std::max(start, offset) - start + cols - 1) / cols;
    const int64_t end_row = std::max<int64_t>(0, std::min(start + t.numel(), end) - start) / cols;
    const Matrix m{start + first_row * cols - offset, end_row - first_row, cols};
    if (m.rows < 1 || (m.rows + m.cols) * rank_of(m) >= m.rows * m.cols) continue;  // the factors would not be smaller
    matrices_.push_back(m);
  }
  int64_t covered = 0;
  for (const auto& m : matrices_) {
    if (m.offset > covered) plain_.push_back({covered, m.offset - covered});
    covered = m.offset + m.rows * m.cols;
    coded_values_ += (m.rows + m.cols) * rank_of(m);
  }
  if (numel > covered) plain_.push_back({covered, numel - covered});
  for (const auto& s : plain_) coded_values_ += s.numel;
}

int64_t LowRankCoding::rank_of(const Matrix& m) const { return std::min({rank_, m.rows, m.cols}); }

torch::Tensor LowRankCoding::view(const torch::Tensor& x, const Matrix& m) const {
  return x.narrow(0, m.offset, m.rows * m.cols).view({m.rows, m.cols});
}

torch::Tensor LowRankCoding::factor(const torch::Tensor& x, uint64_t seed) const {
  torch::NoGradGuard no_grad;
  auto out = torch::empty({coded_values_}, torch::kFloat32);
  int64_t at = 0;
  for (size_t i = 0; i < matrices_.size(); ++i) {
    const auto& mat = matrices_[i];
    const auto m = view(x, mat);
    const int64_t r = rank_of(mat), sketch = std::min({kSketchPerRank * r, mat.rows, mat.cols});
    auto y = m.mm(random_signs(mat.cols, sketch, splitmix64(seed ^ splitmix64(i))));
    for (int k = 0; k < kPowerIterations; ++k) y = m.mm(m.t().mm(orthonormal_columns(y)));
    const auto basis = orthonormal_columns(y);
    const auto [u, s, vh] = at::linalg_svd(basis.t().mm(m), /*full_matrices=*/false);
    // √S on each side keeps both factors at one scale for the blockwise wire codes.
    const auto root = s.narrow(0, 0, r).sqrt();
    out.narrow(0, at, mat.rows * r).view({mat.rows, r}).copy_(basis.mm(u.narrow(1, 0, r)) * root);
    at += mat.rows * r;
    out.narrow(0, at, mat.cols * r).view({mat.cols, r}).copy_(vh.narrow(0, 0, r).t() * root);
    at += mat.cols * r;
  }
  for (const auto& s : plain_) {
    out.narrow(0, at, s.numel).copy_(x.narrow(0, s.offset, s.numel));
    at += s.numel;
  }
  return out;
}

torch::Tensor LowRankCoding::expand(const torch::Tensor& coded) const {
  torch::NoGradGuard no_grad;
  auto out = torch::empty({numel_}, torch::kFloat32);
  int64_t at = 0;
  for (const auto& mat : matrices_) {
    const int64_t r = rank_of(mat);
    const auto p = coded.narrow(0, at, mat.rows * r).view({mat.rows, r});
    at += mat.rows * r;
    const auto q = coded.narrow(0, at, mat.cols * r).view({mat.cols, r});
    at += mat.cols * r;
    view(out, mat).copy_(p.mm(q.t()));
  }
  for (const auto& s : plain_) {
    out.narrow(0, s.offset, s.numel).copy_(coded.narrow(0, at, s.numel));
    at += s.numel;
  }
  throw_unless_finite(out);
  return out;
}

std::shared_ptr<const LowRankCoding> low_rank_coding(const FlatParams& params, int64_t offset, int64_t numel,
                                                     int64_t rank) {
  if (rank == 0) return nullptr;
  return std::make_shared<const LowRankCoding>(params, offset, numel, rank);
}

}  // namespace noloco
