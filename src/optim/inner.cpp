#include "optim/inner.h"

#include <cmath>

#include "util/torch_shim.h"

namespace noloco {

double learning_rate(const InnerConfig& c, int64_t step) {
  if (step < c.warmup) return c.lr * double(step + 1) / double(c.warmup + 1);
  if (step >= c.decay_steps) return c.min_lr;
  const double progress = double(step - c.warmup) / double(std::max<int64_t>(1, c.decay_steps - c.warmup));
  const double coeff = 0.5 * (1.0 + std::cos(M_PI * progress));
  return c.min_lr + coeff * (c.lr - c.min_lr);
}

InnerOptimizer::InnerOptimizer(FlatParams& params, const InnerConfig& c, int64_t chunk_elements)
    : params_(params),
      beta1_(c.beta1),
      beta2_(c.beta2),
      weight_decay_(c.weight_decay),
      lr_(c.lr),
      fused_(shim::has_fused_adamw(params.values().device())) {
  TORCH_CHECK(chunk_elements > 0, "chunk_elements must be positive");
  exp_avg_ = torch::zeros_like(params.values());
  exp_avg_sq_ = torch::zeros_like(params.values());

  std::vector<std::pair<int64_t, int64_t>> decayed;  // stretches of matrices, merged
  int64_t offset = 0;
  groups_.resize(2);
  groups_[0].weight_decay = weight_decay_;
  groups_[1].weight_decay = 0.0;
  for (const auto& [name, t] : params.named()) {
    const int64_t n = t.numel();
    const bool decays = t.dim() >= 2;
    if (decays) {
      if (!decayed.empty() && decayed.back().first + decayed.back().second == offset)
        decayed.back().second += n;
      else
        decayed.emplace_back(offset, n);
    }
    if (fused_) {
      auto& g = groups_[decays ? 0 : 1];
      g.values.push_back(params.values().narrow(0, offset, n));
      g.grads.push_back(params.grads().narrow(0, offset, n));
      g.exp_avg.push_back(exp_avg_.narrow(0, offset, n));
      g.exp_avg_sq.push_back(exp_avg_sq_.narrow(0, offset, n));
    }
    offset += n;
  }
  if (fused_) {
    step_count_ = torch::zeros({}, params.values().options().dtype(torch::kFloat32));
    for (auto& g : groups_) g.steps.assign(g.values.size(), step_count_);
  }

  const int64_t total = params.numel();
  size_t next = 0;  // first stretch of `decayed` that may reach into the chunk
  for (int64_t begin = 0; begin < total; begin += chunk_elements) {
    Chunk chunk{begin, std::min(chunk_elements, total - begin), {}};
    const int64_t end = begin + chunk.length;
    while (next < decayed.size() && decayed[next].first + decayed[next].second <= begin) ++next;
    for (size_t i = next; i < decayed.size() && decayed[i].first < end; ++i) {
      const int64_t from = std::max(begin, decayed[i].first);
      const int64_t to = std::min(end, decayed[i].first + decayed[i].second);
      chunk.decayed.emplace_back(from - begin, to - from);
    }
    chunks_.push_back(std::move(chunk));
  }
}

double InnerOptimizer::clip_gradients(double clip) {
  auto& g = params_.grads();
  const double norm = g.norm().item<double>();
  if (clip > 0 && norm > clip) g.mul_(clip / (norm + 1e-6));
  return norm;
}

void InnerOptimizer::step() {
  torch::NoGradGuard no_grad;
  ++steps_;
  if (fused_) return step_fused();
  step_in_chunks(1 - std::pow(beta1_, steps_), 1 - std::pow(beta2_, steps_));
}

// The operations and scalars of torch::optim::AdamW, in its order, so that the
// result is bit-identical to it (tests/test_inner.cpp checks), one chunk at a time.
void InnerOptimizer::step_in_chunks(double bias_correction1, double bias_correction2) {
  const double decay_factor = 1 - lr_ * weight_decay_;
  const double step_size = lr_ / bias_correction1;
  const double denom_scale = std::sqrt(bias_correction2);
  for (const auto& chunk : chunks_) {
    auto p = params_.values().narrow(0, chunk.offset, chunk.length);
    auto g = params_.grads().narrow(0, chunk.offset, chunk.length);
    auto m = exp_avg_.narrow(0, chunk.offset, chunk.length);
    auto v = exp_avg_sq_.narrow(0, chunk.offset, chunk.length);
    if (weight_decay_ != 0)
      for (const auto& [from, length] : chunk.decayed) p.narrow(0, from, length).mul_(decay_factor);
    m.mul_(beta1_).add_(g, 1 - beta1_);
    v.mul_(beta2_).addcmul_(g, g, 1 - beta2_);
    auto denom = (v.sqrt() / denom_scale).add_(eps_);
    p.addcdiv_(m, denom, -step_size);
  }
}

void InnerOptimizer::step_fused() {
  step_count_.fill_(double(steps_));
  for (auto& g : groups_) {
    if (g.values.empty()) continue;
    shim::fused_adamw(g.values, g.grads, g.exp_avg, g.exp_avg_sq, g.steps, lr_, beta1_, beta2_,
                      g.weight_decay, eps_);
  }
}

void InnerOptimizer::save(TensorMap& out) const {
  if (steps_ == 0) return;
  int64_t offset = 0;
  for (const auto& [name, t] : params_.named()) {
    out["adam.exp_avg." + name] = exp_avg_.narrow(0, offset, t.numel()).view(t.sizes());
    out["adam.exp_avg_sq." + name] = exp_avg_sq_.narrow(0, offset, t.numel()).view(t.sizes());
    offset += t.numel();
  }
}

void InnerOptimizer::load(const TensorMap& in, int64_t steps_taken) {
  torch::NoGradGuard no_grad;
  exp_avg_.zero_();
  exp_avg_sq_.zero_();
  steps_ = steps_taken;
  if (steps_taken == 0) return;
  int64_t offset = 0;
  for (const auto& [name, t] : params_.named()) {
    auto avg = in.find("adam.exp_avg." + name), sq = in.find("adam.exp_avg_sq." + name);
    TORCH_CHECK(avg != in.end() && sq != in.end(), "checkpoint lacks Adam state for ", name);
    TORCH_CHECK(avg->second.sizes() == t.sizes() && sq->second.sizes() == t.sizes(),
                "checkpoint Adam state for ", name, " has the wrong shape");
    exp_avg_.narrow(0, offset, t.numel()).view(t.sizes()).copy_(avg->second);
    exp_avg_sq_.narrow(0, offset, t.numel()).view(t.sizes()).copy_(sq->second);
    offset += t.numel();
  }
}

}  // namespace noloco
