// Named tensors in safetensors files, as torch tensors (the format itself is
// util/safetensors.h). CPU tensors of the file's dtype.
#pragma once
#include <map>
#include <string>

#include "util/safetensors.h"
#include "util/tensor_map.h"

namespace noloco {

std::string serialize_tensors(const TensorMap& tensors, const std::map<std::string, std::string>& metadata = {});
TensorMap tensors_of(const SafetensorsFile& file);
void save_tensors(const std::string& path, const TensorMap& tensors,
                  const std::map<std::string, std::string>& metadata = {});
// Throws std::runtime_error naming the file on anything malformed.
TensorMap load_tensors(const std::string& path, std::map<std::string, std::string>* metadata = nullptr);

}  // namespace noloco
