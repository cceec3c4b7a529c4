// A module's parameters and gradients as views into two contiguous buffers,
// so that every reduction or exchange is one large message, never one per tensor.
#pragma once
#include <string>
#include <utility>
#include <vector>

#include <torch/torch.h>

namespace noloco {

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

 private:
  torch::Tensor values_, grads_;
  std::vector<std::pair<std::string, torch::Tensor>> named_;
};

}  // namespace noloco
