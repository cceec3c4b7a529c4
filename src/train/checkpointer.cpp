#include "train/checkpointer.h"

#include <filesystem>

#include <fmt/format.h>

#include "util/log.h"

#include "train/checkpoint.h"

namespace noloco {

namespace fs = std::filesystem;

Checkpointer::Checkpointer(std::string dir, int64_t every, int64_t keep, int64_t last_step, const ModelConfig& model,
                           std::string run_dir, nlohmann::json info, const TrainingState& state,
                           const FailureDrill& drill)
    : dir_(std::move(dir)),
      every_(every),
      keep_(keep),
      last_step_(last_step),
      model_(model),
      run_dir_(std::move(run_dir)),
      info_(std::move(info)),
      state_(state),
      drill_(drill) {}

std::vector<int64_t> Checkpointer::complete_steps() const { return complete_checkpoint_steps(dir_); }

void Checkpointer::resume_at(int64_t step) {
  for (const auto& later : step_directories(dir_)) {
    if (later.step <= step || !writes_) continue;
    const auto& from = later.path;
    std::string to = from + ".superseded";
    for (int n = 2; fs::exists(to); ++n) to = fmt::format("{}.superseded{}", from, n);
    fs::rename(from, to);
    spdlog::warn("{}: the run resumes at step {}, which every worker holds; this later {}checkpoint is kept as {}",
                 from, step, later.complete ? "" : "incomplete ", to);
  }
  if (step == 0) return;
  const auto path = checkpoint_path(dir_, step);
  auto ckpt = read_checkpoint(path, /*with_state=*/true);
  if (ckpt.model.to_json() != model_.to_json())
    throw std::runtime_error(fmt::format("{}: checkpoint model {} does not match the config {}", path,
                                         ckpt.model.to_json().dump(), model_.to_json().dump()));
  for (const char* key : {"replica", "replicas", "stage", "stages", "method"})
    if (ckpt.info.at(key) != info_.at(key))
      throw std::runtime_error(fmt::format("{}: a checkpoint of {} {}, this worker has {} {}", path, key,
                                           ckpt.info.at(key).dump(), key, info_.at(key).dump()));
  const int64_t held = ckpt.info.at("step").get<int64_t>();
  if (held > last_step_)
    throw std::runtime_error(fmt::format("{}: a checkpoint of step {}, past steps={}", path, held, last_step_));
  if (held != step) throw std::runtime_error(fmt::format("{}: holds step {}, not {}", path, held, step));
  restore_training_state(state_, {ckpt.weights, ckpt.state, ckpt.info}, path);
}

void Checkpointer::after_step(int64_t done) {
  if (!writes_ || (done % every_ != 0 && done != last_step_)) return;
  save(done);
}

void Checkpointer::save(int64_t done) {
  auto snap = capture_training_state(state_, done);
  Checkpoint ck{model_, std::move(snap.weights), std::move(snap.state), info_};
  ck.info.update(snap.counters);
  write_checkpoint(dir_, done, ck, run_dir_, [&] { drill_.inside_checkpoint(done); }, keep_);
}

}  // namespace noloco
