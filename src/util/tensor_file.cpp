#include "util/tensor_file.h"

#include <cstring>

#include <fmt/format.h>

#include "util/files.h"

namespace noloco {

namespace {

std::string dtype_name(torch::ScalarType t) {
  switch (t) {
    case torch::kFloat32: return "F32";
    case torch::kFloat64: return "F64";
    case torch::kBFloat16: return "BF16";
    case torch::kFloat16: return "F16";
    case torch::kInt64: return "I64";
    case torch::kInt32: return "I32";
    case torch::kUInt8: return "U8";
    default: throw std::runtime_error(fmt::format("cannot store dtype {} in safetensors", c10::toString(t)));
  }
}

torch::ScalarType scalar_type(const std::string& d) {
  if (d == "F32") return torch::kFloat32;
  if (d == "F64") return torch::kFloat64;
  if (d == "BF16") return torch::kBFloat16;
  if (d == "F16") return torch::kFloat16;
  if (d == "I64") return torch::kInt64;
  if (d == "I32") return torch::kInt32;
  if (d == "U8") return torch::kUInt8;
  throw std::runtime_error(fmt::format("unsupported safetensors dtype {}", d));
}

}  // namespace

std::string serialize_tensors(const TensorMap& tensors, const std::map<std::string, std::string>& metadata) {
  SafetensorsWriter w;
  for (auto& [k, v] : metadata) w.set_metadata(k, v);
  for (auto& [name, t] : tensors) {
    auto cpu = t.detach().to(torch::kCPU).contiguous();
    w.add(name, dtype_name(cpu.scalar_type()), cpu.sizes().vec(), cpu.data_ptr(), cpu.nbytes());
  }
  return w.serialize();
}

TensorMap tensors_of(const SafetensorsFile& file) {
  TensorMap out;
  for (auto& [name, st] : file.tensors) {
    auto t = torch::empty(st.shape, scalar_type(st.dtype));
    std::memcpy(t.data_ptr(), st.data.data(), st.data.size());
    out[name] = t;
  }
  return out;
}

void save_tensors(const std::string& path, const TensorMap& tensors,
                  const std::map<std::string, std::string>& metadata) {
  write_file_atomic(path, serialize_tensors(tensors, metadata));
}

TensorMap load_tensors(const std::string& path, std::map<std::string, std::string>* metadata) {
  auto file = load_safetensors(path);
  if (metadata) *metadata = file.metadata;
  return tensors_of(file);
}

}  // namespace noloco
