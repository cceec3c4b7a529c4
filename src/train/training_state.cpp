#include "train/training_state.h"

#include <cstring>

namespace noloco {

namespace {

constexpr int64_t kCounters = 2;  // step, AdamW steps

TensorMap outer_state(const OuterOptimizer& outer) {
  TensorMap m;
  outer.save(m);
  return m;
}

int64_t value_count(const TrainingState& s) {
  int64_t n = 3 * s.params.numel();
  for (auto& [name, t] : outer_state(s.outer)) n += t.numel();
  return n;
}

}  // namespace

int64_t training_state_bytes(const TrainingState& s) {
  return kCounters * int64_t(sizeof(int64_t)) + value_count(s) * int64_t(sizeof(float));
}

torch::Tensor pack_training_state(const TrainingState& s, int64_t step) {
  TensorMap adam;
  s.inner.save(adam);
  std::vector<torch::Tensor> parts{s.params.values().detach()};
  for (const char* moment : {"adam.exp_avg.", "adam.exp_avg_sq."})
    for (auto& [name, t] : s.params.named()) {
      const auto it = adam.find(moment + name);
      parts.push_back(it != adam.end() ? it->second : torch::zeros_like(t));
    }
  for (auto& [name, t] : outer_state(s.outer)) parts.push_back(t);
  for (auto& p : parts) p = p.detach().reshape({-1}).to(torch::kCPU, torch::kFloat32);
  const auto values = torch::cat(parts);
  auto bytes = torch::empty({training_state_bytes(s)}, torch::kUInt8);
  const int64_t counters[kCounters] = {step, s.inner.steps_taken()};
  std::memcpy(bytes.data_ptr(), counters, sizeof counters);
  std::memcpy(bytes.data_ptr<uint8_t>() + sizeof counters, values.data_ptr(), size_t(values.nbytes()));
  return bytes;
}

int64_t unpack_training_state(const torch::Tensor& bytes, const TrainingState& s) {
  TORCH_CHECK(bytes.numel() == training_state_bytes(s), "peer state has ", bytes.numel(), " bytes, expected ",
              training_state_bytes(s));
  int64_t counters[kCounters];
  std::memcpy(counters, bytes.data_ptr(), sizeof counters);
  TORCH_CHECK(counters[0] >= 0 && counters[1] >= 0 && counters[1] <= counters[0] + 1,
              "peer state has implausible counters (step ", counters[0], ", AdamW steps ", counters[1], ")");
  auto packed = torch::empty({value_count(s)}, torch::kFloat32);
  std::memcpy(packed.data_ptr(), bytes.data_ptr<uint8_t>() + sizeof counters, size_t(packed.nbytes()));
  torch::NoGradGuard no_grad;
  int64_t offset = 0;
  auto take = [&](const torch::Tensor& like) {
    auto t = packed.narrow(0, offset, like.numel()).view(like.sizes());
    offset += like.numel();
    return t;
  };
  s.params.values().copy_(take(s.params.values()));
  TensorMap adam;
  for (const char* moment : {"adam.exp_avg.", "adam.exp_avg_sq."})
    for (auto& [name, t] : s.params.named()) adam[moment + name] = take(t);
  s.inner.load(adam, counters[1]);
  TensorMap restored;
  for (auto& [name, t] : outer_state(s.outer)) restored[name] = take(t);
  s.outer.load(restored);
  return counters[0];
}

}  // namespace noloco
