// A module's parameters and gradients as views into two contiguous buffers,
// so that every reduction or exchange is one large message, never one per tensor.
#pragma once
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <torch/torch.h>

namespace noloco {

// A rule that keeps some of the weights in a set (activation_subspace:
// optim/subspace_constraint.h). Whoever changes a full-size flat copy of the
// weights applies it: to weights (θ, φ) or to a change of them (gradients,
// outer momentum), which a linear constraint projects without its offset.
class WeightConstraint {
 public:
  virtual ~WeightConstraint() = default;
  virtual void project_weights(torch::Tensor& flat) const = 0;
  virtual void project_change(torch::Tensor& flat) const = 0;
};

class FlatParams {
 public:
  // Re-seats every parameter (and its gradient) of `module` as a view into the
  // flat buffers. Call after the module reaches its device, before building optimizers.
  explicit FlatParams(torch::nn::Module& module);
  // The same for parameters that belong to no LibTorch module (a Python
  // model's, re-seated in place: the caller's tensor objects see the buffer).
  explicit FlatParams(std::vector<std::pair<std::string, torch::Tensor>> named);

  torch::Tensor& values() { return values_; }
  torch::Tensor& grads() { return grads_; }
  const std::vector<std::pair<std::string, torch::Tensor>>& named() const { return named_; }
  int64_t numel() const { return values_.numel(); }
  // Where named()[i] starts in the flat buffers.
  int64_t offset(size_t i) const { return offsets_.at(i); }

  // Keeps the weights under `constraint` from now on, projecting them at once.
  void constrain(std::shared_ptr<const WeightConstraint> constraint);
  // No-ops without a constraint.
  void project_weights(torch::Tensor& flat) const;
  void project_change(torch::Tensor& flat) const;

 private:
  torch::Tensor values_, grads_;
  std::vector<std::pair<std::string, torch::Tensor>> named_;
  std::vector<int64_t> offsets_;
  std::shared_ptr<const WeightConstraint> constraint_;
};

}  // namespace noloco
