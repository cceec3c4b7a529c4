// The inner optimizer every method shares: AdamW with decoupled weight decay on
// 2-D weights only, the learning-rate schedule and global-norm clipping.
#pragma once
#include <map>
#include <string>

#include <torch/torch.h>

#include "optim/flat_params.h"
#include "config/train_config.h"

namespace noloco {

using TensorMap = std::map<std::string, torch::Tensor>;

// Linear warmup to `lr`, then cosine decay to `min_lr` at `decay_steps`, constant after.
double learning_rate(const InnerConfig& c, int64_t step);

class InnerOptimizer {
 public:
  InnerOptimizer(FlatParams& params, const InnerConfig& c);
  void set_lr(double lr);
  // Scales gradients to global norm <= clip (if clip > 0); returns the norm before.
  double clip_gradients(double clip);
  void step() { adam_->step(); }
  int64_t steps_taken() const;
  // Adam moments keyed "adam.exp_avg.<param>" / "adam.exp_avg_sq.<param>".
  void save(TensorMap& out) const;
  void load(const TensorMap& in, int64_t steps_taken);

 private:
  FlatParams& params_;
  std::unique_ptr<torch::optim::AdamW> adam_;
};

}  // namespace noloco
