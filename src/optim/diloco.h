// DiLoCo (Douillard et al., 2023): every H inner steps all replicas average
// their progress Δ = θ − φ in one all-reduce and take the outer momentum step
// on the mean; φ stays identical on every replica.
#pragma once
#include "optim/slow_weights.h"

namespace noloco {

class DiLoCo final : public SlowWeightsMethod {
 public:
  DiLoCo(const OuterConfig& config, Transport& transport, FlatParams& params);

 protected:
  OuterTerms exchange(int64_t outer_step, const torch::Tensor& theta, const torch::Tensor& phi,
                      OuterSync& sync) override;

 private:
  Transport& transport_;
};

}  // namespace noloco
