// Export to the Hugging Face Llama layout: config.json, the weights (one file
// or shards with their index) and the tokenizer files.
#pragma once
#include <cstdint>
#include <memory>
#include <string>

#include "data/tokenizer.h"
#include "model/llama.h"
#include "train/model_choice.h"

namespace noloco {

struct ExportOptions {
  uint64_t shard_bytes = 2000000000;  // Hugging Face's "2GB"
  std::string dtype = "float32";      // float32 | bfloat16 | float16
  std::string replica = kBestModel;  // train/model_choice.h: best, mean or a replica's number
};

// `checkpoint` as accepted by find_checkpoint(). Returns which model it
// exported, in words. Throws naming the problem.
std::string export_hf(const std::string& checkpoint, const std::string& hf_dir, const ExportOptions& options = {});

// A model and its tokenizer, read back from a checkpoint (as find_checkpoint
// accepts it: a run directory or a step) or a Hugging Face Llama directory.
struct TrainedModel {
  LlamaForCausalLM model{nullptr};
  std::unique_ptr<Tokenizer> tokenizer;
  std::string which;  // which model of the run, in words
};
TrainedModel load_trained_model(const std::string& checkpoint, const std::string& replica = kBestModel);

}  // namespace noloco
