// Export to the Hugging Face Llama layout: config.json, the weights (one file
// or shards with their index) and the tokenizer files.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "data/tokenizer.h"
#include "model/llama.h"
#include "train/model_choice.h"

namespace noloco {

struct ExportOptions {
  uint64_t shard_bytes = 2000000000;  // Hugging Face's "2GB"
  std::string dtype;  // float32 | bfloat16 | float16; empty: the imported model's (init_from), else float32
  std::string replica = kBestModel;  // train/model_choice.h: best, mean or a replica's number
};

struct ExportSummary {
  std::string model;   // which model of the run, in words
  std::string config;  // for a run started from a Hugging Face model: what its config.json kept; else empty
};

// `checkpoint` as accepted by find_checkpoint(). A run started from a Hugging
// Face model (init_from) exports that model's config.json, with only the
// fields its training changed (or dtype= asked for) changed. Throws naming
// the problem.
ExportSummary export_hf(const std::string& checkpoint, const std::string& hf_dir, const ExportOptions& options = {});

// A model and its tokenizer, read back from a checkpoint (as find_checkpoint
// accepts it: a run directory or a step) or a Hugging Face Llama directory.
struct TrainedModel {
  LlamaForCausalLM model{nullptr};
  std::unique_ptr<Tokenizer> tokenizer;
  std::string which;  // which model of the run, in words
  bool replica_over_mean = false;  // replica=best took one replica, the mean having validated worse
};
// `imported`'s fields, where `ours` (the trained model's) has another value
// for one it holds, taking ours, each change noted "key old -> new" in
// `changed`; max_position_embeddings stays the imported one's (a shorter
// training context leaves the positions the model serves).
nlohmann::json keep_imported_config(const nlohmann::json& imported, const nlohmann::json& ours,
                                    std::vector<std::string>* changed = nullptr);

TrainedModel load_trained_model(const std::string& checkpoint, const std::string& replica = kBestModel);

}  // namespace noloco
