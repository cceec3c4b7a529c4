#include "util/safetensors_index.h"

#include <set>
#include <stdexcept>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "util/files.h"

namespace noloco {

namespace {

[[noreturn]] void malformed(const std::string& why) {
  throw std::runtime_error("malformed safetensors index: " + why);
}

bool plain_shard_name(const std::string& f) {
  const std::string suffix = ".safetensors";
  return f.size() > suffix.size() && ends_with(f, suffix) && f.find('/') == std::string::npos && f.find('\\') == std::string::npos && f[0] != '.';
}

}  // namespace

std::vector<std::string> SafetensorsIndex::files() const {
  std::set<std::string> unique;
  for (const auto& [name, file] : weight_map) unique.insert(file);
  return {unique.begin(), unique.end()};
}

SafetensorsIndex parse_safetensors_index(const std::string& text) {
  const auto j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) malformed("not valid JSON");
  if (!j.is_object()) malformed("not a JSON object");
  const auto map = j.find("weight_map");
  if (map == j.end() || !map->is_object()) malformed("'weight_map' must be an object of tensor name: file");
  if (map->empty()) malformed("'weight_map' is empty");
  SafetensorsIndex index;
  for (const auto& [name, file] : map->items()) {
    if (name.empty()) malformed("a tensor name is empty");
    if (!file.is_string()) malformed(fmt::format("the file of '{}' must be a string, got {}", name, file.dump()));
    const auto f = file.get<std::string>();
    if (!plain_shard_name(f))
      malformed(fmt::format("the file of '{}' must be a *.safetensors name in the same directory, got '{}'", name, f));
    index.weight_map[name] = f;
  }
  return index;
}

std::string serialize_safetensors_index(const SafetensorsIndex& index, uint64_t total_size) {
  nlohmann::json j = {{"metadata", {{"total_size", total_size}}}, {"weight_map", index.weight_map}};
  return j.dump(2) + "\n";
}

std::string shard_file_name(size_t shard, size_t shards) {
  return fmt::format("model-{:05d}-of-{:05d}.safetensors", shard + 1, shards);
}

std::vector<std::vector<size_t>> plan_shards(const std::vector<uint64_t>& tensor_bytes, uint64_t max_bytes) {
  std::vector<std::vector<size_t>> shards;
  uint64_t filled = 0;
  for (size_t i = 0; i < tensor_bytes.size(); ++i) {
    if (shards.empty() || (filled > 0 && filled + tensor_bytes[i] > max_bytes)) {
      shards.emplace_back();
      filled = 0;
    }
    shards.back().push_back(i);
    filled += tensor_bytes[i];
  }
  return shards;
}

}  // namespace noloco
