// Measures of a residual subspace (model/subspace.h) that its unit tests and
// the pipeline's run tests share.
#pragma once
#include <torch/torch.h>

namespace noloco::testing {

// The largest part of a matrix's columns outside span(U), relative to the matrix.
inline double outside_span(const torch::Tensor& w, const torch::Tensor& u) {
  return (w - u.matmul(u.t().matmul(w))).abs().max().item<double>() / w.abs().max().item<double>();
}

// An embedding's rows outside span(U): the part that training never moves.
inline torch::Tensor frozen_part(const torch::Tensor& embedding, const torch::Tensor& u) {
  return embedding - embedding.matmul(u).matmul(u.t());
}

}  // namespace noloco::testing
