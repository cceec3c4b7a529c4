// The residual stream kept in a shared subspace (activation_subspace=K; the
// idea of Protocol Models, arXiv 2506.01260), so that a pipeline boundary
// carries K numbers a token instead of `hidden`.
//
// Every write to the residual stream that crosses a stage boundary — the
// token embedding's trainable part, o_proj and down_proj of each layer before
// the last stage — is kept in span(U), U a fixed orthonormal hidden × K basis
// drawn from the run's seed. The last stage's layers write freely: nothing
// they write is sent (node0 leaves its tail's layers free likewise). The embedding's
// part outside the span, F = (I − UUᵀ)·E₀ with E₀ the run's initial
// embedding (seeded or imported), is frozen. The residual stream after any
// layer is then exactly
//     h = F[ids] + U·z,   z = Uᵀh   (UᵀF = 0),
// so a stage sends z and the receiver, which knows the micro-batch's ids
// (every worker samples the same windows), rebuilds h. Backward, only Uᵀg
// matters upstream: every parameter before the boundary moves h only inside
// span(U) (the constrained writes carry every other parameter's effect), so
// U·Uᵀg yields the same parameter gradients as g once those of the
// constrained matrices are projected, which the training loop does.
//
// F's scale matters: it is the only full-rank part of the stream before the
// last stage, the tokens' identity every layer reads through its RMSNorm. A
// seeded run scales it to `activation_subspace_token_std`, by default
// min(1, hidden/2048) (config/train_config.cpp): the best scale grows with the
// width (at K = 16, hidden 128: 0.02 +1.2%, 1 +6.0%; hidden 512: 0.02 +4.9%,
// 0.3 −3.7%, 1 +0.2%: docs/pipeline.md) toward node0's fixed N(0, 1)
// embedding from hidden 2048 up; an imported model keeps its own F, which its
// layers were trained to read. F ⟂ U either way, so z needs no subtraction,
// and the export is an ordinary Llama (embed_tokens = F + its in-span part).
#pragma once
#include <cstdint>

#include <torch/torch.h>

namespace noloco {

// K orthonormal columns in R^hidden from `seed`: Gram-Schmidt in double over
// SplitMix64 Gaussians, plain loops (no BLAS or LAPACK), so that every worker
// derives the same basis whatever library it runs on.
torch::Tensor subspace_basis(int64_t hidden, int64_t k, uint64_t seed);

class ResidualSubspace {
 public:
  // `initial_embedding`: E₀, [vocab, hidden]. Tensors live on its device.
  // Layers [0, constrained_layers) write in the span: those before the last
  // stage. `frozen_std` > 0 scales F to that standard deviation; 0 keeps E₀'s.
  ResidualSubspace(int64_t k, uint64_t seed, const torch::Tensor& initial_embedding, int64_t constrained_layers,
                   double frozen_std = 0);
  int64_t k() const { return basis_.size(1); }
  bool constrains_layer(int64_t layer) const { return layer < constrained_layers_; }
  const torch::Tensor& basis() const { return basis_; }

  // [..., hidden] -> [..., K]: the coordinates of h (or of a gradient) in the span.
  torch::Tensor coordinates(const torch::Tensor& h) const;
  // The residual stream of tokens `ids` [B, T] with coordinates z [B, T, K].
  torch::Tensor residual(const torch::Tensor& z, const torch::Tensor& ids) const;
  // A gradient with coordinates z: U·z.
  torch::Tensor span_vector(const torch::Tensor& z) const;

  // In place, for a matrix whose columns are residual-stream vectors
  // (o_proj, down_proj weights [hidden, in]): W ← U·UᵀW.
  void project_columns(torch::Tensor& w) const;
  // In place, for an embedding [vocab, hidden] whose rows are written to the
  // stream: E ← F + E·U·Uᵀ (weights) or E ← E·U·Uᵀ (a change of them).
  void project_embedding(torch::Tensor& e, bool is_change) const;

 private:
  torch::Tensor basis_;  // U, [hidden, K]
  torch::Tensor fixed_;  // F, [vocab, hidden]
  int64_t constrained_layers_;
};

}  // namespace noloco
