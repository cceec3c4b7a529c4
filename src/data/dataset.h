// Token streams for training and validation, and the seeded window sampler.
#pragma once
#include <memory>
#include <string>
#include <utility>

#include <torch/torch.h>

#include "data/tokenizer.h"
#include "config/train_config.h"

namespace noloco {

struct Corpus {
  std::unique_ptr<Tokenizer> tokenizer;
  torch::Tensor train, val;  // 1-D int64 on the CPU
};

// Reads `config.path` (text or token file), builds or loads the tokenizer and
// splits off validation; both parts must hold a window of `context` + 1 tokens. If `run_dir/tokenizer.json` exists, that tokenizer is
// used (resume, or a worker of a launched run); otherwise the new one is saved there.
// Throws std::runtime_error / std::invalid_argument with one-line reasons.
Corpus load_corpus(const DataConfig& config, int64_t context, const std::string& run_dir);

// The model's vocabulary: the tokenizer's where the model does not fix one
// (an imported model may have more rows than its tokenizer has tokens; never fewer).
ModelConfig with_vocabulary(ModelConfig model, const Tokenizer& tokenizer);

struct Batch {
  torch::Tensor inputs, targets;  // [B, T] int64
};

// Random contiguous windows. Window j of global batch `index` is a pure
// function of (seed, index, j), so any replica can take its slice of the
// global batch, runs resume without stored sampler state, and N replicas of
// batch B see exactly what one replica of batch N·B sees.
class WindowSampler {
 public:
  WindowSampler(torch::Tensor tokens, int64_t context, uint64_t seed);
  // Windows [first, first + count) of global batch `index`.
  Batch sample(uint64_t index, int64_t first, int64_t count) const;

 private:
  torch::Tensor tokens_;
  int64_t context_;
  uint64_t seed_;
};

}  // namespace noloco
