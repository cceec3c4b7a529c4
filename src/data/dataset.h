// Token streams for training and validation, and the seeded window sampler.
#pragma once
#include <memory>
#include <string>
#include <utility>

#include <torch/torch.h>

#include "config/train_config.h"
#include "data/token_stream.h"
#include "data/tokenizer.h"

namespace noloco {

struct Corpus {
  std::unique_ptr<Tokenizer> tokenizer;
  TokenStream train, val;
  // What the run's config.yaml names as its tokenizer: the key's value, or
  // the shards' directory whose tokenizer `prepare` left there.
  std::string tokenizer_source;
  // False where val_fraction=0 and no validation files: the run is not validated.
  bool validates = true;
};

// Opens `config.path` (a text file, or token files: a file, a directory or a
// glob of llm.c shards), builds or loads the tokenizer and splits off
// validation (`val_path`, else a directory's val shards, else the tail
// `val_fraction` of the stream, none where it is 0); each part must hold a
// window of `context` + 1 tokens. If `run_dir/tokenizer.json` exists, that tokenizer is used (resume,
// or a worker of a launched run); otherwise the new one is saved there. Text is
// tokenized once per run: into `run_dir/tokens/`, which later workers and
// resumes map. What the run trains on (token files' names, sizes and id
// counts; a text's size and time) is recorded in `run_dir/corpus.json`: a
// resume (`resuming`) over changed data is refused, naming the change, unless
// config.accept_changed_data. Throws std::runtime_error / std::invalid_argument
// with one-line reasons.
Corpus load_corpus(const DataConfig& config, int64_t context, const std::string& run_dir, bool resuming = false);

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
// The seed of the validation windows: the same for every run, so runs can be compared.
constexpr uint64_t kValidationSeed = 0x5eedba11;

class WindowSampler {
 public:
  WindowSampler(TokenStream tokens, int64_t context, uint64_t seed);
  // Windows [first, first + count) of global batch `index`.
  Batch sample(uint64_t index, int64_t first, int64_t count) const;

 private:
  TokenStream tokens_;
  int64_t context_;
  uint64_t seed_;
};

}  // namespace noloco
