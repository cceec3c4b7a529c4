// Fully synchronous data parallelism: the flat gradient buffer is averaged
// over all replicas in one all-reduce per step.
#pragma once
#include "optim/outer.h"

namespace noloco {

class Ddp final : public OuterOptimizer {
 public:
  explicit Ddp(Transport& transport) : transport_(transport) {}
  bool on_gradients(FlatParams& params) override {
    transport_.all_reduce_mean(params.grads());
    return true;
  }

 private:
  Transport& transport_;
};

}  // namespace noloco
