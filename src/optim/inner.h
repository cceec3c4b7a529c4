// The inner optimizer every method shares: AdamW with decoupled weight decay on
// 2-D weights only, the learning-rate schedule and global-norm clipping.
//
// It works on FlatParams' buffers rather than tensor by tensor: one pass per
// operation over cache-sized chunks of the whole model on the CPU (a handful of
// kernels instead of ten per parameter), and LibTorch's fused multi-tensor
// AdamW kernel on CUDA where the LibTorch has one (see util/torch_shim.h).
#pragma once
#include <map>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "config/train_config.h"
#include "optim/flat_params.h"
#include "optim/inner_state.h"
#include "util/tensor_map.h"

namespace noloco {

// Linear warmup to `lr`, then cosine decay to `min_lr` at `decay_steps`, constant after.
double learning_rate(const InnerConfig& c, int64_t step);

class InnerOptimizer final : public InnerState {
 public:
  // The CPU path works on `chunk_elements` at a time (about 4 MiB per buffer:
  // all four buffers' chunks stay in cache across the update's passes).
  InnerOptimizer(FlatParams& params, const InnerConfig& c, int64_t chunk_elements = int64_t(1) << 20);
  void set_lr(double lr) { lr_ = lr; }
  // Scales gradients to global norm <= clip (if clip > 0); returns the norm before.
  double clip_gradients(double clip);
  void step();
  int64_t steps_taken() const override { return steps_; }
  // Adam moments keyed "adam.exp_avg.<param>" / "adam.exp_avg_sq.<param>".
  void save(TensorMap& out) const override;
  void load(const TensorMap& in, int64_t steps_taken) override;
  // Whether step() runs LibTorch's fused kernel (CUDA under LibTorch 2.x).
  bool fused() const { return fused_; }

 private:
  // A stretch [offset, offset + length) of the flat buffers and, within it, the
  // stretches holding matrices (the ones weight decay applies to).
  struct Chunk {
    int64_t offset, length;
    std::vector<std::pair<int64_t, int64_t>> decayed;
  };
  void step_in_chunks(double bias_correction1, double bias_correction2);
  void step_fused();

  FlatParams& params_;
  double beta1_, beta2_, weight_decay_, eps_ = 1e-8;
  double lr_;
  int64_t steps_ = 0;
  bool fused_;
  torch::Tensor exp_avg_, exp_avg_sq_;
  std::vector<Chunk> chunks_;
  // Fused path: per group (decayed, not decayed) the parameters' views of the
  // four flat buffers, and the step count as the kernel wants it (a tensor).
  struct Group {
    std::vector<torch::Tensor> values, grads, exp_avg, exp_avg_sq, steps;
    double weight_decay;
  };
  std::vector<Group> groups_;
  torch::Tensor step_count_;
};

}  // namespace noloco
