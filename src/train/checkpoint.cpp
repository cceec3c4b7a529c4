#include "train/checkpoint.h"

#include <sys/stat.h>

#include <cstring>
#include <filesystem>

#include <fmt/format.h>

#include "util/files.h"
#include "util/safetensors.h"

namespace noloco {

namespace fs = std::filesystem;

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

void save_tensors(const std::string& path, const TensorMap& tensors,
                  const std::map<std::string, std::string>& metadata) {
  SafetensorsWriter w;
  for (auto& [k, v] : metadata) w.set_metadata(k, v);
  for (auto& [name, t] : tensors) {
    auto cpu = t.detach().to(torch::kCPU).contiguous();
    w.add(name, dtype_name(cpu.scalar_type()), cpu.sizes().vec(), cpu.data_ptr(), cpu.nbytes());
  }
  w.write_atomic(path);
}

TensorMap load_tensors(const std::string& path, std::map<std::string, std::string>* metadata) {
  auto file = load_safetensors(path);
  TensorMap out;
  for (auto& [name, st] : file.tensors) {
    auto t = torch::empty(st.shape, scalar_type(st.dtype));
    std::memcpy(t.data_ptr(), st.data.data(), st.data.size());
    out[name] = t;
  }
  if (metadata) *metadata = file.metadata;
  return out;
}

std::string write_checkpoint(const std::string& dir, int64_t step, const Checkpoint& ckpt,
                             const std::string& tokenizer_dir, const std::function<void()>& halfway) {
  fs::create_directories(dir);
  const std::string name = fmt::format("step_{:08d}", step);
  const fs::path final_dir = fs::path(dir) / name;
  const fs::path tmp_dir = fs::path(dir) / (name + ".tmp");
  fs::remove_all(tmp_dir);
  fs::create_directories(tmp_dir);
  save_tensors((tmp_dir / "model.safetensors").string(), ckpt.weights,
               {{"format", "pt"}, {"noloco_model", ckpt.model.to_json().dump()}});
  if (halfway) halfway();
  save_tensors((tmp_dir / "state.safetensors").string(), ckpt.state);
  write_json_atomic((tmp_dir / "state.json").string(), ckpt.info);
  for (auto f : {"tokenizer.json", "tokenizer.model"}) {
    const fs::path src = fs::path(tokenizer_dir) / f;
    if (fs::exists(src)) fs::copy_file(src, tmp_dir / f, fs::copy_options::overwrite_existing);
  }
  fs::remove_all(final_dir);
  fs::rename(tmp_dir, final_dir);
  write_file_atomic((fs::path(dir) / "latest").string(), name + "\n");
  return final_dir.string();
}

std::string find_checkpoint(const std::string& path) {
  const fs::path p(path);
  if (fs::exists(p / "model.safetensors")) return p.string();
  for (const fs::path& d : {p, p / "checkpoints" / "r0"}) {
    if (!fs::exists(d / "latest")) continue;
    auto name = read_file((d / "latest").string());
    while (!name.empty() && (name.back() == '\n' || name.back() == ' ')) name.pop_back();
    if (name.empty() || name.find('/') != std::string::npos)
      throw std::runtime_error(fmt::format("{}: malformed 'latest' file", d.string()));
    return (d / name).string();
  }
  return "";
}

Checkpoint read_checkpoint(const std::string& dir, bool with_state) {
  Checkpoint c;
  std::map<std::string, std::string> meta;
  c.weights = load_tensors(dir + "/model.safetensors", &meta);
  auto cfg = meta.find("noloco_model");
  if (cfg == meta.end())
    throw std::runtime_error(fmt::format("{}/model.safetensors: no noloco_model metadata", dir));
  auto j = nlohmann::json::parse(cfg->second, nullptr, false);
  if (j.is_discarded()) throw std::runtime_error(fmt::format("{}: model metadata is not JSON", dir));
  try {
    c.model = ModelConfig::from_json(j);
  } catch (const std::exception& e) {
    throw std::runtime_error(fmt::format("{}: bad model metadata: {}", dir, e.what()));
  }
  if (fs::exists(dir + "/state.json")) c.info = read_json(dir + "/state.json");
  // A pipeline stage's checkpoint holds its own slice of the model.
  const bool stage_slice = c.info.is_object() && c.info.value("stages", 1) > 1;
  // The names and shapes must be exactly those of the model the config describes.
  const auto shapes = c.model.parameter_shapes();
  const std::map<std::string, std::vector<int64_t>> expected(shapes.begin(), shapes.end());
  if (!stage_slice && expected.size() != c.weights.size())
    throw std::runtime_error(fmt::format("{}: {} tensors, the model has {}", dir, c.weights.size(), expected.size()));
  for (auto& [name, t] : c.weights) {
    const auto shape = expected.find(name);
    if (shape == expected.end()) throw std::runtime_error(fmt::format("{}: unexpected tensor {}", dir, name));
    if (t.sizes() != c10::IntArrayRef(shape->second))
      throw std::runtime_error(fmt::format("{}: tensor {} has shape {}, expected {}", dir, name, c10::str(t.sizes()),
                                           c10::str(c10::IntArrayRef(shape->second))));
    if (t.scalar_type() != torch::kFloat32) t = t.to(torch::kFloat32);
  }
  if (with_state) c.state = load_tensors(dir + "/state.safetensors");
  return c;
}

Checkpoint read_whole_model(const std::string& dir) {
  auto c = read_checkpoint(dir, /*with_state=*/false);
  const int stages = c.info.is_object() ? c.info.value("stages", 1) : 1;
  if (stages > 1) {
    // Sibling stages of the same replica, same step: <run>/checkpoints/r<replica·stages+s>/step_N.
    const fs::path here(dir);
    const int replica = c.info.value("replica", 0);
    TensorMap merged;
    for (int s = 0; s < stages; ++s) {
      const auto stage_dir = here.parent_path().parent_path() / fmt::format("r{}", replica * stages + s) / here.filename();
      if (!fs::exists(stage_dir / "model.safetensors"))
        throw std::runtime_error(fmt::format("{}: stage {} of this pipelined checkpoint is missing ({})", dir, s,
                                             stage_dir.string()));
      for (auto& [name, t] : read_checkpoint(stage_dir.string(), false).weights) merged[name] = t;
    }
    c.weights = std::move(merged);
  }
  const auto expected = c.model.parameter_shapes();
  for (auto& [name, shape] : expected)
    if (!c.weights.count(name)) throw std::runtime_error(fmt::format("{}: missing tensor {}", dir, name));
  if (c.weights.size() != expected.size())
    throw std::runtime_error(fmt::format("{}: {} tensors, the model has {}", dir, c.weights.size(), expected.size()));
  return c;
}

}  // namespace noloco
