#include "model/subspace.h"

#include <cmath>
#include <stdexcept>
#include <vector>

#include <fmt/format.h>

#include "util/splitmix.h"

namespace noloco {

namespace {

// A standard normal from two SplitMix64 draws (Box-Muller), a pure function of `counter`.
double gaussian(uint64_t seed, uint64_t counter) {
  const uint64_t a = splitmix64(seed ^ splitmix64(2 * counter)), b = splitmix64(seed ^ splitmix64(2 * counter + 1));
  const double u1 = (double(a >> 11) + 1.0) * 0x1.0p-53;  // (0, 1]
  const double u2 = double(b >> 11) * 0x1.0p-53;
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * M_PI * u2);
}

}  // namespace

torch::Tensor subspace_basis(int64_t hidden, int64_t k, uint64_t seed) {
  if (k < 1 || k > hidden)
    throw std::invalid_argument(fmt::format("activation_subspace must be in [1, hidden={}], got {}", hidden, k));
  const uint64_t basis_seed = splitmix64(seed ^ 0x5b5b5b5b5b5b5b5bull);  // apart from the weights' seed
  std::vector<std::vector<double>> columns(size_t(k), std::vector<double>(size_t(hidden), 0.0));
  for (int64_t j = 0; j < k; ++j) {
    auto& v = columns[size_t(j)];
    for (int64_t i = 0; i < hidden; ++i) v[size_t(i)] = gaussian(basis_seed, uint64_t(j * hidden + i));
    // Modified Gram-Schmidt, twice: orthogonal to double precision.
    for (int pass = 0; pass < 2; ++pass)
      for (int64_t p = 0; p < j; ++p) {
        const auto& u = columns[size_t(p)];
        double dot = 0;
        for (int64_t i = 0; i < hidden; ++i) dot += u[size_t(i)] * v[size_t(i)];
        for (int64_t i = 0; i < hidden; ++i) v[size_t(i)] -= dot * u[size_t(i)];
      }
    double norm = 0;
    for (double x : v) norm += x * x;
    norm = std::sqrt(norm);
    for (double& x : v) x /= norm;
  }
  auto basis = torch::empty({hidden, k}, torch::kFloat64);
  auto a = basis.accessor<double, 2>();
  for (int64_t i = 0; i < hidden; ++i)
    for (int64_t j = 0; j < k; ++j) a[i][j] = columns[size_t(j)][size_t(i)];
  return basis.to(torch::kFloat32);
}

ResidualSubspace::ResidualSubspace(int64_t k, uint64_t seed, const torch::Tensor& initial_embedding,
                                   int64_t constrained_layers, double frozen_std)
    : constrained_layers_(constrained_layers) {
  torch::NoGradGuard no_grad;
  const auto e0 = initial_embedding.detach().to(torch::kFloat32);
  basis_ = subspace_basis(e0.size(1), k, seed).to(e0.device());
  fixed_ = e0 - e0.matmul(basis_).matmul(basis_.t());
  if (frozen_std > 0) fixed_.mul_(frozen_std / fixed_.std().item<double>());
}

torch::Tensor ResidualSubspace::coordinates(const torch::Tensor& h) const {
  return h.matmul(basis_.to(h.scalar_type()));
}

torch::Tensor ResidualSubspace::residual(const torch::Tensor& z, const torch::Tensor& ids) const {
  const auto fixed = fixed_.index_select(0, ids.reshape({-1}).to(fixed_.device())).view({ids.size(0), ids.size(1), -1});
  return fixed + span_vector(z);
}

torch::Tensor ResidualSubspace::span_vector(const torch::Tensor& z) const {
  return z.to(basis_.device(), torch::kFloat32).matmul(basis_.t());
}

void ResidualSubspace::project_columns(torch::Tensor& w) const {
  const auto u = basis_.to(w.scalar_type());
  w.copy_(u.matmul(u.t().matmul(w)));
}

void ResidualSubspace::project_embedding(torch::Tensor& e, bool is_change) const {
  const auto u = basis_.to(e.scalar_type());
  auto in_span = e.matmul(u).matmul(u.t());
  if (!is_change) in_span.add_(fixed_.to(e.scalar_type()));
  e.copy_(in_span);
}

}  // namespace noloco
