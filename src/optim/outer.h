// Outer methods wrap the inner optimizer without changing the training loop:
// the loop calls on_gradients() after backward and after_inner_step() after
// each AdamW step; a method acts in whichever hook it needs.
#pragma once
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "comm/communicator.h"
#include "optim/flat_params.h"
#include "optim/grouping.h"
#include "optim/inner.h"
#include "train/config.h"

namespace noloco {

// What an outer step did, for the metrics log.
struct OuterSync {
  int64_t outer_step = 0;
  std::vector<int> group;    // who it averaged with (all replicas for DiLoCo)
  std::vector<int> arrived;  // of those, whose data was counted
};

class OuterOptimizer {
 public:
  virtual ~OuterOptimizer() = default;
  // After backward, before clipping: DDP averages gradients here.
  virtual void on_gradients(FlatParams&) {}
  // After inner step `step` (0-based); reports the outer step when one ran.
  virtual std::optional<OuterSync> after_inner_step(int64_t /*step*/, FlatParams&) { return std::nullopt; }
  // State that must survive a restart (slow weights, momentum).
  virtual void save(TensorMap&) const {}
  virtual void load(const TensorMap&) {}
};

// The outer momentum step shared by DiLoCo and NoLoCo (fp32):
//   m ← α·m + β·mean_delta + γ·(mean_phi − φ);  φ ← φ + m;  θ ← φ
// mean_phi undefined means the pull term is zero (DiLoCo, or NoLoCo with γ = β
// after folding the pull into mean_delta = mean_G(θ) − φ).
void outer_momentum_step(torch::Tensor& phi, torch::Tensor& momentum, torch::Tensor& theta,
                         const torch::Tensor& mean_delta, const torch::Tensor& mean_phi, double alpha,
                         double beta, double gamma);

// "none", "ddp", "diloco" or "noloco". `comm` may be null only for "none".
std::unique_ptr<OuterOptimizer> make_outer_optimizer(const TrainConfig& c, Communicator* comm,
                                                     FlatParams& params);

}  // namespace noloco
