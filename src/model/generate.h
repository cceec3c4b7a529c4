// Autoregressive sampling with temperature and top-k.
#pragma once
#include <cstdint>
#include <vector>

#include "model/llama.h"

namespace noloco {

struct SamplingOptions {
  int64_t tokens = 200;
  double temperature = 0.8;  // 0: greedy
  int64_t top_k = 40;        // 0: whole vocabulary
  uint64_t seed = 0;
};

// Returns prompt followed by the generated tokens. The context is cropped to
// the model's last `context` tokens, as nanoGPT does.
std::vector<int32_t> generate(LlamaForCausalLM& model, std::vector<int32_t> prompt,
                              const SamplingOptions& options);

}  // namespace noloco
