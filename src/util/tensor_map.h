// Named tensors: model weights under Hugging Face names, optimizer state.
#pragma once
#include <map>
#include <string>

#include <torch/torch.h>

namespace noloco {

using TensorMap = std::map<std::string, torch::Tensor>;

}  // namespace noloco
