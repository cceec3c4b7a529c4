// The CLI's Llama and training data for one replica of a run config, for a
// training loop of the user's own: the same weights from the same seed, and
// the same batches at each step, as `noloco train` gives that replica. The
// user steps it with their own optimizer (the Python module's noloco.Llama).
#pragma once
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "config/train_config.h"
#include "data/dataset.h"
#include "pipeline/worker_model.h"

namespace noloco {

class ConfiguredLlama {
 public:
  // `config_path` and `overrides` as `noloco train` takes them (out= is where
  // the tokenizer and tokenized text go); throws std::invalid_argument on bad
  // keys, a pipelined config or a replica outside the run.
  ConfiguredLlama(const std::string& config_path, const std::vector<std::string>& overrides, int replica);

  const TrainConfig& config() const { return config_; }
  const ModelConfig& model_config() const { return arch_; }
  // The model's parameters under their Hugging Face names, in the order the CLI flattens them.
  std::vector<std::pair<std::string, torch::Tensor>> named_parameters();
  // Forward and backward of the replica's batch of inner step `step`: the
  // gradients are added to the parameters' .grad; returns the mean loss.
  double train_step(int64_t step);
  // Mean validation loss over eval_batches (the CLI's validation windows); NaN without validation (val_fraction=0).
  double evaluate(int64_t step);
  // The CLI's learning rate at inner step `step` (warmup, cosine decay).
  double learning_rate(int64_t step) const;

 private:
  TrainConfig config_;
  Corpus corpus_;
  ModelConfig arch_;
  WindowSampler train_windows_, val_windows_;
  std::unique_ptr<WorkerModel> model_;
};

}  // namespace noloco
