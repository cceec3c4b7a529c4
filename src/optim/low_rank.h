// Low-rank outer messages (issue 47; PowerSGD's idea, Vogels et al. 2019):
// each weight matrix's increment M (m × n) travels as two factors P (m × r)
// and Q (n × r) with M ≈ P·Qᵀ, (m + n)·r values instead of m·n. At our
// scale a pseudo-gradient is far more low-rank than sparse: at hidden 512
// rank 4 holds 37-41% of its energy in 1.8% of the values, where the top 64
// of every 4096 values hold 15% (docs/results-log.md, scripts/topk_energy.py).
//
// The factors come from a randomized SVD (Halko et al. 2011: a seeded
// random sketch, two power iterations, an exact SVD of the small projection),
// so they are close to the best rank-r approximation and depend on nothing
// but the increment and the seed: no state to checkpoint or hand over.
// Values outside whole matrix rows (norm vectors, a matrix cut by a fragment
// boundary) and matrices too small to gain travel as they are.
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include <torch/torch.h>

#include "optim/flat_params.h"

namespace noloco {

class LowRankCoding {
 public:
  // The matrices of the slice [offset, offset + numel) of `params`' flat
  // weights, each coded at rank `rank` (> 0).
  LowRankCoding(const FlatParams& params, int64_t offset, int64_t numel, int64_t rank);
  // Values a message carries: every matrix's factors, then the values sent as they are.
  int64_t coded_values() const { return coded_values_; }
  int64_t matrices() const { return int64_t(matrices_.size()); }
  // x (numel values, fp32, CPU) as coded_values() values.
  torch::Tensor factor(const torch::Tensor& x, uint64_t seed) const;
  // The numel values that `coded` (coded_values() of them) stands for.
  // Throws std::runtime_error if they are not all finite.
  torch::Tensor expand(const torch::Tensor& coded) const;

 private:
  struct Matrix {
    int64_t offset = 0, rows = 0, cols = 0;  // offset in the slice
  };
  struct Span {
    int64_t offset = 0, numel = 0;
  };
  std::vector<Matrix> matrices_;
  // Every matrix's rank (the factors' columns), at most `rank`.
  int64_t rank_of(const Matrix& m) const;
  torch::Tensor view(const torch::Tensor& x, const Matrix& m) const;

  std::vector<Span> plain_;  // sent as they are, in slice order
  int64_t numel_, rank_, coded_values_ = 0;
};

// A LowRankCoding for each fragment, or none (rank 0).
std::shared_ptr<const LowRankCoding> low_rank_coding(const FlatParams& params, int64_t offset, int64_t numel,
                                                     int64_t rank);

}  // namespace noloco
