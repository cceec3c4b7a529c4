#include "train/checkpoint.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <regex>

#include <fmt/format.h>

#include "config/run_layout.h"
#include "data/tokenizer.h"
#include "util/crc32c.h"
#include "util/files.h"
#include "util/log.h"
#include "util/safetensors.h"
#include "util/tensor_file.h"
#include "util/run_files.h"

namespace noloco {

namespace fs = std::filesystem;

namespace {
constexpr const char* kChecksums = "checksums.json";
}  // namespace

std::vector<StepDirectory> step_directories(const std::string& dir) {
  static const std::regex name("step_([0-9]{1,18})");
  std::vector<StepDirectory> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    std::smatch m;
    const auto file = e.path().filename().string();
    if (!e.is_directory() || !std::regex_match(file, m, name)) continue;
    out.push_back({std::stoll(m[1]), e.path().string(), fs::exists(e.path() / kChecksums)});
  }
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.step < b.step; });
  return out;
}

namespace {

std::string hex(uint32_t crc) { return fmt::format("{:08x}", crc); }

// step_<N> directories of `dir` that are complete, oldest first.
std::vector<std::pair<int64_t, fs::path>> complete_checkpoints(const fs::path& dir) {
  std::vector<std::pair<int64_t, fs::path>> out;
  for (const auto& d : step_directories(dir.string()))
    if (d.complete) out.emplace_back(d.step, d.path);
  return out;
}

// Whether `dir` holds step directories, complete or not (a step_<N>.tmp, a
// write that never finished, was never a checkpoint: the next write of that
// step replaces it).
bool has_step_directories(const fs::path& dir) { return !step_directories(dir.string()).empty(); }

void fsync_directory(const fs::path& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY);
  if (fd < 0) return;
  ::fsync(fd);
  ::close(fd);
}

// A checkpoint's files, read and checked against checksums.json.
class VerifiedFiles {
 public:
  explicit VerifiedFiles(std::string dir) : dir_(std::move(dir)) {
    const auto path = dir_ + "/" + kChecksums;
    if (!fs::exists(path)) {
      spdlog::warn("{} has no {} (written by an older noloco): its files are not verified", dir_, kChecksums);
      return;
    }
    sums_ = read_json(path);
    if (!sums_.is_object() || !sums_.contains("files") || !sums_["files"].is_object())
      throw std::runtime_error(fmt::format("{}: malformed {}", dir_, kChecksums));
  }
  std::string read(const std::string& name) const {
    const auto path = dir_ + "/" + name;
    auto bytes = read_file(path);
    if (!sums_.is_null()) {
      const auto& files = sums_["files"];
      if (!files.contains(name)) throw std::runtime_error(fmt::format("{}: not listed in {}", path, kChecksums));
      const auto expected = files[name].is_string() ? files[name].get<std::string>() : "";
      if (hex(crc32c(bytes)) != expected)
        throw std::runtime_error(fmt::format("{} is corrupt: its CRC-32C is {}, the checkpoint recorded {}", path,
                                             hex(crc32c(bytes)), expected));
    }
    return bytes;
  }

 private:
  std::string dir_;
  nlohmann::json sums_;
};

// state.json's fields, each checked: a bad one names itself.
void validate_info(const std::string& dir, const nlohmann::json& info) {
  auto fail = [&](const std::string& why) { throw std::runtime_error(fmt::format("{}/state.json: {}", dir, why)); };
  if (!info.is_object()) fail("not a JSON object");
  auto integer = [&](const char* key, int64_t min, int64_t max) {
    const auto it = info.find(key);
    if (it == info.end()) fail(fmt::format("'{}' is missing", key));
    if (!it->is_number_integer()) fail(fmt::format("'{}' must be an integer, got {}", key, it->dump()));
    const auto v = it->get<int64_t>();
    if (v < min || v > max) fail(fmt::format("'{}' must be in [{}, {}], got {}", key, min, max, v));
    return v;
  };
  const int64_t step = integer("step", 0, int64_t(1) << 40);
  integer("adam_steps", 0, step);
  const int64_t replicas = integer("replicas", 1, 1 << 20), stages = integer("stages", 1, 1 << 10);
  integer("replica", 0, replicas - 1);
  integer("stage", 0, stages - 1);
  if (!info.contains("method") || !info["method"].is_string()) fail("'method' must be a string");
}

}  // namespace

std::string write_checkpoint(const std::string& dir, int64_t step, const Checkpoint& ckpt,
                             const std::string& tokenizer_dir, const std::function<void()>& halfway, int64_t keep) {
  fs::create_directories(dir);
  const std::string name = fmt::format("step_{:08d}", step);
  const fs::path final_dir = fs::path(dir) / name;
  const fs::path tmp_dir = fs::path(dir) / (name + ".tmp");
  if (fs::exists(final_dir)) throw std::runtime_error(fmt::format("refusing to overwrite checkpoint {}", final_dir.string()));
  fs::remove_all(tmp_dir);
  fs::create_directories(tmp_dir);
  nlohmann::json sums = nlohmann::json::object();
  auto put = [&](const std::string& file, const std::string& bytes) {
    write_file_atomic((tmp_dir / file).string(), bytes);
    sums[file] = hex(crc32c(bytes));
  };
  put("model.safetensors",
      serialize_tensors(ckpt.weights, {{"format", "pt"}, {"noloco_model", ckpt.model.to_json().dump()}}));
  if (halfway) halfway();
  put("state.safetensors", serialize_tensors(ckpt.state, {}));
  put("state.json", ckpt.info.dump(2) + "\n");
  for (const auto& f : tokenizer_files()) {
    const fs::path src = fs::path(tokenizer_dir) / f;
    if (fs::exists(src)) put(f, read_file(src.string()));
  }
  // Written last: its presence is what makes the checkpoint complete.
  write_json_atomic((tmp_dir / kChecksums).string(), {{"format", "crc32c"}, {"files", sums}});
  fsync_directory(tmp_dir);
  fs::rename(tmp_dir, final_dir);
  fsync_directory(dir);
  write_file_atomic((fs::path(dir) / "latest").string(), name + "\n");
  if (keep > 0) {
    auto all = complete_checkpoints(dir);
    for (size_t i = 0; i + size_t(keep) < all.size(); ++i) fs::remove_all(all[i].second);
  }
  return final_dir.string();
}

std::string find_checkpoint(const std::string& path) {
  const fs::path p(path);
  // A checkpoint by what it is (its state, its checksums), not by the weight
  // file's name, which a Hugging Face directory shares.
  if (fs::exists(p / "model.safetensors") && (fs::exists(p / "state.json") || fs::exists(p / kChecksums)))
    return p.string();
  for (const fs::path& d : {p, fs::path(run_files::worker_checkpoints(path, 0))}) {
    const auto complete = complete_checkpoints(d);
    if (!complete.empty()) return complete.back().second.string();
    if (has_step_directories(d))
      throw std::runtime_error(fmt::format("{} holds checkpoint directories but none is complete (no {})",
                                           d.string(), kChecksums));
  }
  return "";
}

std::vector<int64_t> complete_checkpoint_steps(const std::string& dir) {
  std::vector<int64_t> steps;
  for (const auto& [step, path] : complete_checkpoints(dir)) steps.push_back(step);
  return steps;
}

std::string checkpoint_path(const std::string& dir, int64_t step) {
  return (fs::path(dir) / fmt::format("step_{:08d}", step)).string();
}

Checkpoint read_checkpoint(const std::string& dir, bool with_state) {
  Checkpoint c;
  const VerifiedFiles files(dir);
  SafetensorsFile model;
  try {
    model = parse_safetensors(files.read("model.safetensors"));
  } catch (const std::runtime_error& e) {
    throw std::runtime_error(fmt::format("{}/model.safetensors: {}", dir, e.what()));
  }
  c.weights = tensors_of(model);
  auto cfg = model.metadata.find("noloco_model");
  if (cfg == model.metadata.end())
    throw std::runtime_error(fmt::format("{}/model.safetensors: no noloco_model metadata", dir));
  auto j = nlohmann::json::parse(cfg->second, nullptr, false);
  if (j.is_discarded()) throw std::runtime_error(fmt::format("{}: model metadata is not JSON", dir));
  try {
    c.model = ModelConfig::from_json(j);
  } catch (const std::exception& e) {
    throw std::runtime_error(fmt::format("{}: bad model metadata: {}", dir, e.what()));
  }
  if (fs::exists(dir + "/state.json")) {
    c.info = nlohmann::json::parse(files.read("state.json"), nullptr, false);
    validate_info(dir, c.info);
  } else if (with_state) {
    throw std::runtime_error(fmt::format("{}: state.json is missing", dir));
  }
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
  if (with_state) {
    try {
      c.state = tensors_of(parse_safetensors(files.read("state.safetensors")));
    } catch (const std::runtime_error& e) {
      throw std::runtime_error(fmt::format("{}/state.safetensors: {}", dir, e.what()));
    }
  }
  return c;
}

Checkpoint read_whole_model(const std::string& dir) {
  auto c = read_checkpoint(dir, /*with_state=*/false);
  const int stages = c.info.is_object() ? c.info.value("stages", 1) : 1;
  if (stages > 1) {
    // Sibling stages of the same replica, same step: <run>/checkpoints/r<speaker of the stage>/step_N.
    const fs::path here(dir);
    const int replica = c.info.value("replica", 0);
    const RunLayout pipeline(stages, /*replica_workers=*/1);
    TensorMap merged;
    for (int s = 0; s < stages; ++s) {
      const auto stage_dir =
          here.parent_path().parent_path() / fmt::format("r{}", pipeline.speaker(replica, s)) / here.filename();
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
