// Export to the Hugging Face Llama layout: config.json + model.safetensors.
#pragma once
#include <string>

namespace noloco {

// `checkpoint` as accepted by find_checkpoint(). Writes hf_dir/config.json,
// hf_dir/model.safetensors and the tokenizer files.
void export_hf(const std::string& checkpoint, const std::string& hf_dir);

}  // namespace noloco
