// The inner optimizer's share of a replica's state, as checkpoints and the
// hand-over to a restarted or joining replica carry it: noloco's AdamW, or
// the optimizer of a user's own loop (the Python module's), whose state
// travels as named tensors noloco does not interpret.
#pragma once
#include <cstdint>

#include "util/tensor_map.h"

namespace noloco {

class InnerState {
 public:
  virtual ~InnerState() = default;
  virtual void save(TensorMap& out) const = 0;
  // `steps_taken` is the saved steps_taken(): the optimizer's own step count.
  virtual void load(const TensorMap& in, int64_t steps_taken) = 0;
  virtual int64_t steps_taken() const = 0;
};

}  // namespace noloco
