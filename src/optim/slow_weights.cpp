#include "optim/slow_weights.h"

namespace noloco {

void outer_momentum_step(torch::Tensor& phi, torch::Tensor& momentum, torch::Tensor& theta, const OuterTerms& terms,
                         double alpha, double beta) {
  torch::NoGradGuard no_grad;
  momentum.mul_(alpha).add_(terms.mean_delta, beta);
  if (terms.mean_phi.defined()) momentum.add_(terms.mean_phi - phi, terms.gamma);
  phi.add_(momentum);
  theta.copy_(phi);
}

SlowWeightsMethod::SlowWeightsMethod(const OuterConfig& config, FlatParams& params)
    : config_(config), phi_(params.values().detach().clone()), momentum_(torch::zeros_like(phi_)) {}

std::optional<OuterSync> SlowWeightsMethod::after_inner_step(int64_t step, FlatParams& params) {
  if ((step + 1) % config_.interval != 0) return std::nullopt;
  OuterSync sync;
  sync.outer_step = (step + 1) / config_.interval - 1;
  torch::NoGradGuard no_grad;
  auto& theta = params.values();
  const auto terms = exchange(sync.outer_step, theta, phi_, sync);
  outer_momentum_step(phi_, momentum_, theta, terms, config_.momentum, config_.lr);
  return sync;
}

void SlowWeightsMethod::save(TensorMap& out) const {
  out["outer.phi"] = phi_;
  out["outer.momentum"] = momentum_;
}

void SlowWeightsMethod::load(const TensorMap& in) {
  auto phi = in.find("outer.phi"), m = in.find("outer.momentum");
  TORCH_CHECK(phi != in.end() && m != in.end(), "checkpoint lacks the outer optimizer state");
  TORCH_CHECK(phi->second.numel() == phi_.numel() && m->second.numel() == phi_.numel(),
              "checkpoint outer state has the wrong size");
  phi_.copy_(phi->second);
  momentum_.copy_(m->second);
}

}  // namespace noloco
