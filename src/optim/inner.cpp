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

InnerOptimizer::InnerOptimizer(FlatParams& params, const InnerConfig& c) : params_(params) {
  std::vector<torch::Tensor> decay, no_decay;
  for (auto& [name, t] : params.named()) (t.dim() >= 2 ? decay : no_decay).push_back(t);
  auto options = [&](double wd) {
    return std::make_unique<torch::optim::AdamWOptions>(
        torch::optim::AdamWOptions(c.lr).betas({c.beta1, c.beta2}).eps(1e-8).weight_decay(wd));
  };
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(decay, options(c.weight_decay));
  groups.emplace_back(no_decay, options(0.0));
  adam_ = std::make_unique<torch::optim::AdamW>(groups, *options(c.weight_decay));
}

void InnerOptimizer::set_lr(double lr) {
  for (auto& g : adam_->param_groups()) static_cast<torch::optim::AdamWOptions&>(g.options()).lr(lr);
}

double InnerOptimizer::clip_gradients(double clip) {
  auto& g = params_.grads();
  const double norm = g.norm().item<double>();
  if (clip > 0 && norm > clip) g.mul_(clip / (norm + 1e-6));
  return norm;
}

int64_t InnerOptimizer::steps_taken() const {
  const auto& first = params_.named().front().second;
  auto it = adam_->state().find(shim::optimizer_state_key(first));
  if (it == adam_->state().end()) return 0;
  return static_cast<const torch::optim::AdamWParamState&>(*it->second).step();
}

void InnerOptimizer::save(TensorMap& out) const {
  for (auto& [name, t] : params_.named()) {
    auto it = adam_->state().find(shim::optimizer_state_key(t));
    if (it == adam_->state().end()) continue;
    auto& s = static_cast<const torch::optim::AdamWParamState&>(*it->second);
    out["adam.exp_avg." + name] = s.exp_avg();
    out["adam.exp_avg_sq." + name] = s.exp_avg_sq();
  }
}

void InnerOptimizer::load(const TensorMap& in, int64_t steps_taken) {
  torch::NoGradGuard no_grad;
  if (steps_taken == 0) return;
  for (auto& [name, t] : params_.named()) {
    auto avg = in.find("adam.exp_avg." + name), sq = in.find("adam.exp_avg_sq." + name);
    TORCH_CHECK(avg != in.end() && sq != in.end(), "checkpoint lacks Adam state for ", name);
    TORCH_CHECK(avg->second.sizes() == t.sizes() && sq->second.sizes() == t.sizes(),
                "checkpoint Adam state for ", name, " has the wrong shape");
    auto state = std::make_unique<torch::optim::AdamWParamState>();
    state->step(steps_taken);
    state->exp_avg(avg->second.to(t.options()).clone());
    state->exp_avg_sq(sq->second.to(t.options()).clone());
    adam_->state()[shim::optimizer_state_key(t)] = std::move(state);
  }
}

}  // namespace noloco
