// A replica's whole training state as one flat fp32 tensor, so that a live
// replica can hand it to a restarted one over the network (rejoin). The
// layout follows the parameter order, so both sides agree without a manifest:
// weights, AdamW first moments, second moments, then the outer method's state.
#pragma once
#include <torch/torch.h>

#include "optim/flat_params.h"
#include "optim/inner.h"
#include "optim/outer.h"

namespace noloco {

int64_t training_state_numel(FlatParams& params, const OuterOptimizer& outer);
torch::Tensor pack_training_state(FlatParams& params, const InnerOptimizer& inner, const OuterOptimizer& outer);
void unpack_training_state(const torch::Tensor& packed, int64_t adam_steps, FlatParams& params, InnerOptimizer& inner,
                           OuterOptimizer& outer);

}  // namespace noloco
