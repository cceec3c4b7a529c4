#include "train/peer_state.h"

namespace noloco {

namespace {

TensorMap outer_state(const OuterOptimizer& outer) {
  TensorMap m;
  outer.save(m);
  return m;
}

}  // namespace

int64_t training_state_numel(FlatParams& params, const OuterOptimizer& outer) {
  int64_t n = 3 * params.numel();
  for (auto& [name, t] : outer_state(outer)) n += t.numel();
  return n;
}

torch::Tensor pack_training_state(FlatParams& params, const InnerOptimizer& inner, const OuterOptimizer& outer) {
  TensorMap adam;
  inner.save(adam);
  std::vector<torch::Tensor> parts{params.values().detach()};
  for (const char* moment : {"adam.exp_avg.", "adam.exp_avg_sq."})
    for (auto& [name, t] : params.named()) {
      const auto it = adam.find(moment + name);
      parts.push_back(it != adam.end() ? it->second : torch::zeros_like(t));
    }
  for (auto& [name, t] : outer_state(outer)) parts.push_back(t);
  for (auto& p : parts) p = p.detach().reshape({-1}).to(torch::kCPU, torch::kFloat32);
  return torch::cat(parts);
}

void unpack_training_state(const torch::Tensor& packed, int64_t adam_steps, FlatParams& params, InnerOptimizer& inner,
                           OuterOptimizer& outer) {
  TORCH_CHECK(packed.numel() == training_state_numel(params, outer), "peer state has ", packed.numel(),
              " values, expected ", training_state_numel(params, outer));
  torch::NoGradGuard no_grad;
  int64_t offset = 0;
  auto take = [&](const torch::Tensor& like) {
    auto t = packed.narrow(0, offset, like.numel()).view(like.sizes());
    offset += like.numel();
    return t;
  };
  params.values().copy_(take(params.values()));
  TensorMap adam;
  for (const char* moment : {"adam.exp_avg.", "adam.exp_avg_sq."})
    for (auto& [name, t] : params.named()) adam[moment + name] = take(t);
  inner.load(adam, adam_steps);
  TensorMap restored;
  for (auto& [name, t] : outer_state(outer)) restored[name] = take(t);
  outer.load(restored);
}

}  // namespace noloco
