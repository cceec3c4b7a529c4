// What one worker computes in a step: the whole model, or one pipeline stage
// that exchanges activations with neighbouring stages (pipeline/stage.h).
// The training loop is the same for both.
#pragma once
#include <cmath>
#include <memory>

#include <torch/torch.h>

#include "data/dataset.h"
#include "model/llama.h"
#include "train/config.h"

namespace noloco {

class ForwardBackward {
 public:
  virtual ~ForwardBackward() = default;
  // The parameters this worker owns, named as in the whole model.
  virtual torch::nn::Module& module() = 0;
  // Accumulates the gradients of step `step` (grad_accum micro-batches) and
  // returns its loss, or NaN on a worker that does not compute the loss.
  virtual double train_step(int64_t step) = 0;
  // Mean validation loss over eval_batches, NaN where not computed.
  virtual double evaluate() = 0;
  // Whether train_step and evaluate return losses here.
  virtual bool computes_loss() const { return true; }
  // The whole model, where this worker holds all of it (for samples).
  virtual LlamaForCausalLM* whole_model() { return nullptr; }
};

// Windows for training (sliced per replica) and validation (the same on all).
struct StepData {
  const WindowSampler& train;
  const WindowSampler& val;
  int replica = 0;
};

// The unpipelined model, initialised from c.seed, on `device`.
std::unique_ptr<ForwardBackward> make_whole_model(const TrainConfig& c, const ModelConfig& arch, StepData data,
                                                  torch::Device device);

}  // namespace noloco
