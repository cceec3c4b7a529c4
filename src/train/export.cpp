#include "train/export.h"

#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "data/tokenizer.h"
#include "model/hf_directory.h"
#include "train/checkpoint.h"
#include "train/model_choice.h"
#include "util/files.h"
#include "util/run_files.h"

namespace noloco {

namespace fs = std::filesystem;

namespace {

torch::ScalarType export_dtype(const std::string& name) {
  if (name == "float32") return torch::kFloat32;
  if (name == "bfloat16") return torch::kBFloat16;
  if (name == "float16") return torch::kFloat16;
  throw std::invalid_argument(fmt::format("dtype must be float32, bfloat16 or float16, got '{}'", name));
}

// The checkpoints that make a model, and what to tell the user it is.
struct ModelCheckpoints {
  std::vector<std::string> paths;  // one: that checkpoint; several: the mean of their weights
  std::string which;
  bool replica_over_mean = false;  // replica=best took one replica, its mean having validated worse
};

// The checkpoints of a run directory that make the model `replica` names:
// each replica's first stage (read_whole_model joins its other stages) at
// the newest step every replica holds (the mean, or the best by the run's
// validation at that step), or one replica's newest. No paths when the run
// holds no checkpoints.
ModelCheckpoints replica_checkpoints(const fs::path& run_dir, const std::string& replica) {
  std::map<int, std::pair<fs::path, std::vector<int64_t>>> replicas;
  std::error_code ec;
  for (const auto& dir : fs::directory_iterator(run_dir / run_files::kCheckpoints, ec)) {
    const auto steps = complete_checkpoint_steps(dir.path().string());
    if (steps.empty()) continue;
    const auto info = read_json(checkpoint_path(dir.path().string(), steps.back()) + "/state.json");
    if (info.value("stage", 0) == 0) replicas[info.value("replica", 0)] = {dir.path(), steps};
  }
  if (replicas.empty()) return {};
  if (replica != kMeanOfReplicas && replica != kBestModel) {
    int which = -1;
    try {
      which = std::stoi(replica);
    } catch (const std::exception&) {
    }
    if (!replicas.count(which)) {
      std::vector<int> held;
      for (const auto& r : replicas) held.push_back(r.first);
      throw std::invalid_argument(fmt::format("replica={}: {} holds checkpoints of replicas {} (or say best or mean)",
                                              replica, run_dir.string(), fmt::join(held, ", ")));
    }
    const auto& [dir, steps] = replicas.at(which);
    return {{checkpoint_path(dir.string(), steps.back())}, "replica " + replica};
  }
  for (int64_t step : std::vector<int64_t>(replicas.begin()->second.second.rbegin(),
                                           replicas.begin()->second.second.rend())) {
    std::map<int, std::string> at_step;
    for (const auto& [r, held] : replicas)
      if (std::find(held.second.begin(), held.second.end(), step) != held.second.end())
        at_step[r] = checkpoint_path(held.first.string(), step);
    if (at_step.size() != replicas.size()) continue;
    ModelChoice choice{std::nullopt, "the mean of its replicas"};
    if (replica == kBestModel) {
      const auto validated = validated_models(run_dir.string());
      const auto at = validated.find(step);
      choice = choose_model(at == validated.end() ? ValidatedModels{} : at->second);
    }
    if (choice.replica) {
      if (at_step.count(*choice.replica)) return {{at_step.at(*choice.replica)}, choice.why, true};
      choice.why = fmt::format("the mean of its replicas: its best validated, {}, left no checkpoint of step {}",
                               *choice.replica, step);
    }
    std::vector<std::string> paths;
    for (const auto& [r, path] : at_step) paths.push_back(path);
    return {paths, choice.why};
  }
  throw std::runtime_error(fmt::format("{}: its replicas hold no checkpoint of one common step; name one with "
                                       "replica=N",
                                       run_dir.string()));
}

struct TrainedWeights {
  Checkpoint checkpoint;
  std::string path;  // the checkpoint its tokenizer is read from; empty: none found
  ModelCheckpoints chosen;
};

// The model `replica` names of `checkpoint` (a run directory, a directory of
// checkpoints or one checkpoint).
TrainedWeights read_trained_weights(const std::string& checkpoint, const std::string& replica) {
  const fs::path given(checkpoint);
  auto chosen = fs::is_directory(given / run_files::kCheckpoints) ? replica_checkpoints(given, replica) : ModelCheckpoints{};
  if (chosen.paths.empty()) {
    const auto path = find_checkpoint(checkpoint);
    if (path.empty()) return {};
    chosen = {{path}, "checkpoint " + path};
  }
  const auto& paths = chosen.paths;
  auto model = read_whole_model(paths[0]);
  if (paths.size() > 1) {
    for (auto& [name, t] : model.weights) {
      auto sum = t.to(torch::kFloat64);
      for (size_t k = 1; k < paths.size(); ++k) sum += read_whole_model(paths[k]).weights.at(name).to(torch::kFloat64);
      t = (sum / double(paths.size())).to(t.scalar_type());
    }
  }
  return {std::move(model), paths[0], chosen};
}

}  // namespace

namespace {

// Moves the files of a finished export from `staging` into `hf_dir`: the
// directory itself where there is none, else file by file over an earlier
// export, whose weight and tokenizer files (which may be named otherwise,
// or be more shards) go first.
void publish_export(const fs::path& staging, const fs::path& hf_dir) {
  if (!fs::exists(hf_dir)) {
    fs::rename(staging, hf_dir);
    return;
  }
  remove_hf_weights(hf_dir.string());
  for (const auto& f : tokenizer_files()) fs::remove(hf_dir / f);
  for (const auto& entry : fs::directory_iterator(staging)) fs::rename(entry.path(), hf_dir / entry.path().filename());
  fs::remove(staging);
}

}  // namespace

nlohmann::json keep_imported_config(const nlohmann::json& imported, const nlohmann::json& ours,
                                    std::vector<std::string>* changed) {
  auto out = imported;
  for (const auto& [key, value] : ours.items()) {
    const auto theirs = imported.find(key);
    // Training at a shorter window leaves the positions the model serves as they were.
    if (theirs == imported.end() || key == "max_position_embeddings" || *theirs == value) continue;
    out[key] = value;
    if (changed) changed->push_back(fmt::format("{} {} -> {}", key, theirs->dump(), value.dump()));
  }
  return out;
}

namespace {

// The config.json of the model a run started from (init_from), which the
// run kept beside its config.yaml; empty when it started from none.
std::string imported_config_of(const std::string& checkpoint) {
  fs::path dir(checkpoint);
  for (int up = 0; up < 4 && !dir.empty(); ++up, dir = dir.parent_path())
    if (fs::exists(dir / kImportedHfConfig)) return (dir / kImportedHfConfig).string();
  return "";
}

// What config.json calls the weights' dtype, in the spelling it uses.
const char* dtype_key(const nlohmann::json& config) { return config.contains("dtype") ? "dtype" : "torch_dtype"; }

}  // namespace

ExportSummary export_hf(const std::string& checkpoint, const std::string& hf_dir, const ExportOptions& options) {
  if (options.shard_bytes == 0) throw std::invalid_argument("shard_size must be positive");
  const auto [ckpt, path, chosen] = read_trained_weights(checkpoint, options.replica);
  if (path.empty()) throw std::runtime_error(fmt::format("no checkpoint found at '{}'", checkpoint));
  const auto imported_path = imported_config_of(path);
  const auto imported = imported_path.empty() ? nlohmann::json() : read_json(imported_path);
  auto dtype_name = options.dtype;
  if (dtype_name.empty()) {  // the imported model's, else fp32
    const auto theirs = imported.is_object() ? imported.find(dtype_key(imported)) : imported.end();
    dtype_name = imported.is_object() && theirs != imported.end() && theirs->is_string() &&
                         (*theirs == "float32" || *theirs == "bfloat16" || *theirs == "float16")
                     ? theirs->get<std::string>()
                     : "float32";
  }
  const auto dtype = export_dtype(dtype_name);
  const auto tokenizer = load_tokenizer(path);
  ExportSummary summary{chosen.which, ""};
  // Written beside its destination and moved there whole once complete: an
  // export that fails (a full disk) leaves no partial model behind.
  fs::path target = fs::path(hf_dir).lexically_normal();
  if (!target.has_filename()) target = target.parent_path();  // "dir/"
  const fs::path staging = target.string() + fmt::format(".partial-{}", ::getpid());
  fs::remove_all(staging);
  try {
    // Our parameter names are already LlamaForCausalLM's.
    write_hf_weights(staging.string(), ckpt.weights, options.shard_bytes, dtype);
    auto config = ckpt.model.to_hf_json();
    config["torch_dtype"] = dtype_name;
    if (imported.is_object()) {
      config.erase("torch_dtype");
      config[dtype_key(imported)] = dtype_name;
      std::vector<std::string> changed;
      config = keep_imported_config(imported, config, &changed);
      summary.config = changed.empty() ? "config.json: init_from's, unchanged"
                                       : fmt::format("config.json: init_from's, with {} as trained or asked",
                                                     fmt::join(changed, ", "));
    }
    write_json_atomic((staging / "config.json").string(), config);
    tokenizer->save_hf(staging.string());
    publish_export(staging, target);
  } catch (...) {
    std::error_code ec;
    fs::remove_all(staging, ec);
    throw;
  }
  return summary;
}

TrainedModel load_trained_model(const std::string& checkpoint, const std::string& replica) {
  const auto [ckpt, path, chosen] = read_trained_weights(checkpoint, replica);
  const bool hf = path.empty() && is_hf_directory(checkpoint);
  if (path.empty() && !hf)
    throw std::runtime_error(fmt::format("no checkpoint or Hugging Face directory found at '{}'", checkpoint));
  TrainedModel trained;
  trained.which = hf ? "a Hugging Face model" : chosen.which;
  trained.replica_over_mean = chosen.replica_over_mean;
  trained.tokenizer = load_tokenizer(hf ? checkpoint : path);
  if (hf) {
    trained.model = LlamaForCausalLM(read_hf_config(checkpoint));
    load_hf_weights(trained.model, checkpoint);
    return trained;
  }
  trained.model = LlamaForCausalLM(ckpt.model);
  torch::NoGradGuard no_grad;
  for (auto& p : trained.model->named_parameters()) p.value().copy_(ckpt.weights.at(p.key()));
  return trained;
}

}  // namespace noloco
