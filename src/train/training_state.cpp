#include "train/training_state.h"

#include <cstring>
#include <set>

#include <fmt/format.h>

#include "optim/pace.h"
#include "util/error_text.h"
#include "util/safetensors.h"
#include "util/tensor_file.h"

namespace noloco {

StateSnapshot capture_training_state(const TrainingState& s, int64_t step) {
  StateSnapshot snap;
  for (auto& [name, t] : s.params.named()) snap.weights[name] = t;
  s.inner.save(snap.state);
  s.outer.save(snap.state);
  snap.counters = {{"step", step}, {"adam_steps", s.inner.steps_taken()}};
  return snap;
}

int64_t restore_training_state(const TrainingState& s, const StateSnapshot& snap, const std::string& source) {
  auto counter = [&](const char* key) {
    const auto it = snap.counters.find(key);
    if (it == snap.counters.end() || !it->is_number_integer())
      throw std::runtime_error(fmt::format("{}: counter '{}' is missing or not an integer", source, key));
    return it->get<int64_t>();
  };
  const int64_t step = counter("step"), adam_steps = counter("adam_steps");
  if (step < 0 || adam_steps < 0 || adam_steps > step + 1)
    throw std::runtime_error(
        fmt::format("{}: implausible counters (step {}, AdamW steps {})", source, step, adam_steps));
  torch::NoGradGuard no_grad;
  for (auto& [name, t] : s.params.named()) {
    const auto it = snap.weights.find(name);
    if (it == snap.weights.end())
      throw std::runtime_error(fmt::format("{}: lacks {} (another stage's state?)", source, name));
    if (!it->second.sizes().equals(t.sizes()))
      throw std::runtime_error(fmt::format("{}: {} has shape {}, this model's is {}", source, name,
                                           c10::str(it->second.sizes()), c10::str(t.sizes())));
  }
  try {
    for (auto& [name, t] : s.params.named()) t.copy_(snap.weights.at(name));
    s.inner.load(snap.state, adam_steps);
    s.outer.load(snap.state);
  } catch (const std::exception& e) {
    throw std::runtime_error(fmt::format("{}: {}", source, error_text(e)));
  }
  return step;
}

torch::Tensor serialize_training_state(const TrainingState& s, int64_t step) {
  auto snap = capture_training_state(s, step);
  TensorMap all;
  for (auto& [name, t] : snap.state)
    if (!is_pace_state(name)) all[name] = t;
  for (auto& [name, t] : snap.weights) all[name] = t;
  const auto bytes = serialize_tensors(all, {{"counters", snap.counters.dump()}});
  auto out = torch::empty({int64_t(bytes.size())}, torch::kUInt8);
  std::memcpy(out.data_ptr(), bytes.data(), bytes.size());
  return out;
}

int64_t deserialize_training_state(const torch::Tensor& bytes, const TrainingState& s) {
  const std::string source = "the state handed over";
  const auto file = parse_safetensors(std::string(reinterpret_cast<const char*>(bytes.data_ptr()), size_t(bytes.numel())));
  StateSnapshot snap;
  const auto counters = file.metadata.find("counters");
  if (counters != file.metadata.end()) snap.counters = nlohmann::json::parse(counters->second, nullptr, false);
  if (!snap.counters.is_object()) throw std::runtime_error(source + ": no counters in its metadata");
  std::set<std::string> weights;
  for (auto& [name, t] : s.params.named()) weights.insert(name);
  for (auto& [name, t] : tensors_of(file)) (weights.count(name) ? snap.weights : snap.state)[name] = t;
  return restore_training_state(s, snap, source);
}

int64_t training_state_max_bytes(const TrainingState& s) {
  const auto snap = capture_training_state(s, 0);
  int64_t n = 0;
  for (const auto* part : {&snap.weights, &snap.state})
    for (auto& [name, t] : *part) n += int64_t(t.nbytes()) + 256;
  // A donor's state may also hold exchange results in flight (overlap=true),
  // which a fresh one lacks: at most two values per weight.
  return 2 * n + (int64_t(1) << 16);
}

}  // namespace noloco
