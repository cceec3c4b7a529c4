#include "train/export.h"

#include <filesystem>

#include <fmt/format.h>

#include "train/checkpoint.h"
#include "util/files.h"

namespace noloco {

namespace fs = std::filesystem;

void export_hf(const std::string& checkpoint, const std::string& hf_dir) {
  const auto path = find_checkpoint(checkpoint);
  if (path.empty()) throw std::runtime_error(fmt::format("no checkpoint found at '{}'", checkpoint));
  const auto ckpt = read_whole_model(path);
  fs::create_directories(hf_dir);
  // Our parameter names are already LlamaForCausalLM's.
  save_tensors(hf_dir + "/model.safetensors", ckpt.weights, {{"format", "pt"}});
  write_json_atomic(hf_dir + "/config.json", ckpt.model.to_hf_json());
  for (auto f : {"tokenizer.json", "tokenizer.model"}) {
    const fs::path src = fs::path(path) / f;
    if (fs::exists(src)) fs::copy_file(src, fs::path(hf_dir) / f, fs::copy_options::overwrite_existing);
  }
}

}  // namespace noloco
