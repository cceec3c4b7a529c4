// Export to the Hugging Face Llama layout: config.json, the weights (one file
// or shards with their index) and the tokenizer files.
#pragma once
#include <cstdint>
#include <string>

namespace noloco {

struct ExportOptions {
  uint64_t shard_bytes = 2000000000;  // Hugging Face's "2GB"
  std::string dtype = "float32";      // float32 | bfloat16 | float16
};

// `checkpoint` as accepted by find_checkpoint(). Throws naming the problem.
void export_hf(const std::string& checkpoint, const std::string& hf_dir, const ExportOptions& options = {});

}  // namespace noloco
