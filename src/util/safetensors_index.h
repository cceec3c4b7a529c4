// Sharded safetensors: model-0000k-of-0000n.safetensors files and the index
// beside them, model.safetensors.index.json = {"metadata": {"total_size": N},
// "weight_map": {tensor name: shard file}}. Torch-free, so it can be fuzzed.
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace noloco {

struct SafetensorsIndex {
  std::map<std::string, std::string> weight_map;  // tensor name -> shard file name
  // The shard files, sorted, each once.
  std::vector<std::string> files() const;
};

// Throws std::runtime_error with a one-line reason: not JSON, no weight_map,
// a name or file that is not a string, a file name that is not a plain
// *.safetensors name in the same directory (a peer's or a download's index
// must not point elsewhere on disk).
SafetensorsIndex parse_safetensors_index(const std::string& text);
std::string serialize_safetensors_index(const SafetensorsIndex& index, uint64_t total_size);

// Hugging Face's shard names: model-00001-of-00003.safetensors.
std::string shard_file_name(size_t shard, size_t shards);

// Consecutive groups of tensors (in the given order) of at most `max_bytes`
// each; a tensor larger than that gets a shard of its own.
std::vector<std::vector<size_t>> plan_shards(const std::vector<uint64_t>& tensor_bytes, uint64_t max_bytes);

}  // namespace noloco
