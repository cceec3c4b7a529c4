#include "model/hf_directory.h"

#include <filesystem>
#include <regex>
#include <stdexcept>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "util/files.h"
#include "util/safetensors_index.h"
#include "util/tensor_file.h"

namespace noloco {

namespace fs = std::filesystem;

namespace {

constexpr const char* kIndex = "model.safetensors.index.json";
constexpr const char* kSingleFile = "model.safetensors";

[[noreturn]] void fail(const std::string& dir, const std::string& why) {
  throw std::runtime_error(fmt::format("{}: {}", dir, why));
}

// The directory's tensors as stored, each checked to come from the shard the index names.
TensorMap read_stored_tensors(const std::string& dir) {
  const fs::path root(dir);
  SafetensorsIndex index;
  std::vector<std::string> files;
  if (fs::exists(root / kIndex)) {
    try {
      index = parse_safetensors_index(read_file((root / kIndex).string()));
    } catch (const std::runtime_error& e) {
      fail(dir, fmt::format("{}: {}", kIndex, e.what()));
    }
    files = index.files();
  } else if (fs::exists(root / kSingleFile)) {
    files = {kSingleFile};
  } else {
    fail(dir, fmt::format("holds neither {} nor {}", kSingleFile, kIndex));
  }
  TensorMap stored;
  std::map<std::string, std::string> source;
  for (const auto& file : files) {
    const auto path = root / file;
    if (!fs::exists(path)) fail(dir, fmt::format("shard {} listed in {} is missing", file, kIndex));
    for (auto& [name, tensor] : load_tensors(path.string())) {
      if (const auto seen = source.find(name); seen != source.end())
        fail(dir, fmt::format("tensor '{}' is in both {} and {}", name, seen->second, file));
      if (!index.weight_map.empty()) {
        const auto listed = index.weight_map.find(name);
        if (listed == index.weight_map.end() || listed->second != file)
          fail(dir, fmt::format("{} holds '{}', which {} places {}", file, name, kIndex,
                                listed == index.weight_map.end() ? "nowhere" : "in " + listed->second));
      }
      source[name] = file;
      stored[name] = tensor;
    }
  }
  for (const auto& [name, file] : index.weight_map)
    if (!source.count(name)) fail(dir, fmt::format("{} places '{}' in {}, which does not hold it", kIndex, name, file));
  return stored;
}

bool tied_embeddings(const std::string& dir) {
  const auto j = read_json(dir + "/config.json");
  const auto it = j.find("tie_word_embeddings");
  return it != j.end() && it->is_boolean() && it->get<bool>();
}

}  // namespace

bool is_hf_directory(const std::string& dir) { return fs::is_regular_file(fs::path(dir) / "config.json"); }

TensorMap read_hf_weights(const std::string& dir, const ModelConfig& config) {
  auto stored = read_stored_tensors(dir);
  // Some exporters keep rotary frequencies as a buffer; they follow from rope_theta.
  static const std::regex rotary_buffer(R"(.*\.rotary_emb\.inv_freq)");
  for (auto it = stored.begin(); it != stored.end();)
    it = std::regex_match(it->first, rotary_buffer) ? stored.erase(it) : std::next(it);
  if (tied_embeddings(dir)) {
    // Some exporters also write the tied head; it is the embedding matrix.
    if (config.tied_embeddings) stored.erase("lm_head.weight");
    // A run that unties them (tie_embeddings=false) starts its head as a copy.
    else if (!stored.count("lm_head.weight") && stored.count("model.embed_tokens.weight"))
      stored["lm_head.weight"] = stored["model.embed_tokens.weight"];
  }
  TensorMap weights;
  for (const auto& [name, shape] : config.parameter_shapes()) {
    const auto it = stored.find(name);
    if (it == stored.end()) fail(dir, fmt::format("no tensor '{}'", name));
    const auto& t = it->second;
    if (!t.is_floating_point())
      fail(dir, fmt::format("'{}' holds {}, not floating-point weights", name, c10::toString(t.scalar_type())));
    if (t.sizes() != c10::IntArrayRef(shape))
      fail(dir, fmt::format("'{}' has shape [{}], config.json implies [{}]", name, fmt::join(t.sizes(), ", "),
                            fmt::join(shape, ", ")));
    weights[name] = t.to(torch::kFloat32).contiguous();
    stored.erase(it);
  }
  if (!stored.empty())
    fail(dir, fmt::format("tensor '{}' is not part of LlamaForCausalLM with this config", stored.begin()->first));
  return weights;
}

void load_hf_weights(LlamaForCausalLM& model, const std::string& dir) {
  const auto weights = read_hf_weights(dir, model->config);
  torch::NoGradGuard no_grad;
  for (auto& p : model->named_parameters()) p.value().copy_(weights.at(p.key()));
}

void remove_hf_weights(const std::string& dir) {
  static const std::regex weight_file(R"(model(-\d{5}-of-\d{5})?\.safetensors(\.index\.json)?)");
  for (const auto& entry : fs::directory_iterator(dir))
    if (std::regex_match(entry.path().filename().string(), weight_file)) fs::remove(entry.path());
}

void write_hf_weights(const std::string& dir, const TensorMap& weights, uint64_t shard_bytes,
                      torch::ScalarType dtype) {
  fs::create_directories(dir);
  remove_hf_weights(dir);
  std::vector<std::string> names;
  std::vector<uint64_t> bytes;
  uint64_t total = 0;
  for (const auto& [name, t] : weights) {
    names.push_back(name);
    bytes.push_back(uint64_t(t.numel()) * c10::elementSize(dtype));
    total += bytes.back();
  }
  const auto shards = plan_shards(bytes, shard_bytes);
  const std::map<std::string, std::string> metadata = {{"format", "pt"}};
  auto shard_tensors = [&](const std::vector<size_t>& members) {
    TensorMap out;
    for (auto i : members) out[names[i]] = weights.at(names[i]).to(torch::kCPU, dtype);
    return out;
  };
  if (shards.size() <= 1) {
    save_tensors(dir + "/" + kSingleFile, shard_tensors(shards.empty() ? std::vector<size_t>{} : shards[0]), metadata);
    return;
  }
  SafetensorsIndex index;
  for (size_t s = 0; s < shards.size(); ++s) {
    const auto file = shard_file_name(s, shards.size());
    save_tensors(dir + "/" + file, shard_tensors(shards[s]), metadata);
    for (auto i : shards[s]) index.weight_map[names[i]] = file;
  }
  // Written last: a reader that finds the index finds every shard it names.
  write_file_atomic(dir + "/" + kIndex, serialize_safetensors_index(index, total));
}

}  // namespace noloco
