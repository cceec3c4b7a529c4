#include "train/export.h"

#include <filesystem>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "data/tokenizer.h"
#include "model/hf_directory.h"
#include "train/checkpoint.h"
#include "util/files.h"

namespace noloco {

namespace fs = std::filesystem;

namespace {

torch::ScalarType export_dtype(const std::string& name) {
  if (name == "float32") return torch::kFloat32;
  if (name == "bfloat16") return torch::kBFloat16;
  if (name == "float16") return torch::kFloat16;
  throw std::invalid_argument(fmt::format("dtype must be float32, bfloat16 or float16, got '{}'", name));
}

}  // namespace

void export_hf(const std::string& checkpoint, const std::string& hf_dir, const ExportOptions& options) {
  const auto dtype = export_dtype(options.dtype);
  if (options.shard_bytes == 0) throw std::invalid_argument("shard_size must be positive");
  const auto path = find_checkpoint(checkpoint);
  if (path.empty()) throw std::runtime_error(fmt::format("no checkpoint found at '{}'", checkpoint));
  const auto ckpt = read_whole_model(path);
  const auto tokenizer = load_tokenizer(path);
  // Our parameter names are already LlamaForCausalLM's.
  write_hf_weights(hf_dir, ckpt.weights, options.shard_bytes, dtype);
  auto config = ckpt.model.to_hf_json();
  config["torch_dtype"] = options.dtype;
  write_json_atomic(hf_dir + "/config.json", config);
  // An earlier export's tokenizer files would describe another vocabulary.
  for (const auto& f : tokenizer_files()) fs::remove(fs::path(hf_dir) / f);
  tokenizer->save_hf(hf_dir);
}

TrainedModel load_trained_model(const std::string& checkpoint) {
  const auto path = find_checkpoint(checkpoint);
  const bool hf = path.empty() && is_hf_directory(checkpoint);
  if (path.empty() && !hf)
    throw std::runtime_error(fmt::format("no checkpoint or Hugging Face directory found at '{}'", checkpoint));
  TrainedModel trained;
  trained.tokenizer = load_tokenizer(hf ? checkpoint : path);
  if (hf) {
    trained.model = LlamaForCausalLM(read_hf_config(checkpoint));
    load_hf_weights(trained.model, checkpoint);
    return trained;
  }
  const auto ckpt = read_whole_model(path);
  trained.model = LlamaForCausalLM(ckpt.model);
  torch::NoGradGuard no_grad;
  for (auto& p : trained.model->named_parameters()) p.value().copy_(ckpt.weights.at(p.key()));
  return trained;
}

}  // namespace noloco
