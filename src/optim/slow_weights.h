// What DiLoCo and NoLoCo share: slow weights φ and outer momentum m, an outer
// step every H inner steps, and the momentum step
//   m ← α·m + β·mean_delta + γ·(mean_phi − φ);  φ ← φ + m;  θ ← φ
// Each method only says how its replicas compute mean_delta and mean_phi
// (torchft's LocalSGD/DiLoCo split: the algorithm overrides one sync method).
#pragma once
#include "optim/outer.h"

namespace noloco {

// The averages an exchange produced; mean_phi undefined: no pull term.
struct OuterTerms {
  torch::Tensor mean_delta, mean_phi;
  double gamma = 0;
};

// The outer momentum step above, in fp32, in place.
void outer_momentum_step(torch::Tensor& phi, torch::Tensor& momentum, torch::Tensor& theta, const OuterTerms& terms,
                         double alpha, double beta);

class SlowWeightsMethod : public OuterOptimizer {
 public:
  SlowWeightsMethod(const OuterConfig& config, FlatParams& params);
  std::optional<OuterSync> after_inner_step(int64_t step, FlatParams& params) final;
  void save(TensorMap& out) const override;
  void load(const TensorMap& in) override;

 protected:
  // The exchange of outer step `outer_step` over this replica's θ and φ.
  virtual OuterTerms exchange(int64_t outer_step, const torch::Tensor& theta, const torch::Tensor& phi,
                              OuterSync& sync) = 0;
  const OuterConfig& config_;

 private:
  torch::Tensor phi_, momentum_;
};

}  // namespace noloco
