// The flat inner optimizer against LibTorch's own AdamW (the independent
// reference): the same update bit for bit on the CPU, and its state saved and
// restored exactly.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "model/llama.h"
#include "optim/flat_params.h"
#include "optim/inner.h"

using namespace noloco;

namespace {

ModelConfig small_config() {
  ModelConfig c;
  c.vocab_size = 13;
  c.hidden = 16;
  c.layers = 2;
  c.heads = 2;
  c.intermediate = 40;
  c.context = 8;
  return c;
}

InnerConfig adam_config() {
  InnerConfig c;
  c.lr = 3e-3;
  c.beta1 = 0.9;
  c.beta2 = 0.99;
  c.weight_decay = 0.1;
  return c;
}

LlamaForCausalLM make_model() {
  LlamaForCausalLM m(small_config());
  init_weights(m, 3);
  return m;
}

// Random gradients, the same sequence for every caller.
void fill_gradients(std::vector<torch::Tensor> params, int step) {
  torch::NoGradGuard no_grad;
  auto gen = at::detail::createCPUGenerator(100 + step);
  for (auto& p : params) {
    auto g = at::empty(p.sizes(), torch::kFloat32);
    g.normal_(0.0, 1.0, gen);
    if (!p.grad().defined()) p.mutable_grad() = torch::zeros_like(p);
    p.mutable_grad().copy_(g);
  }
}

bool bit_identical(const torch::Tensor& a, const torch::Tensor& b) {
  return a.sizes() == b.sizes() && torch::equal(a, b);
}

}  // namespace

// Chunks of 100 elements: weight-decay stretches start and end inside chunks
// and cross their borders, and the last chunk is partial.
TEST(InnerOptimizer, MatchesTorchAdamWBitForBit) {
  auto reference = make_model();
  auto ours = make_model();
  FlatParams flat(*ours);
  const auto c = adam_config();
  InnerOptimizer inner(flat, c, /*chunk_elements=*/100);

  std::vector<torch::Tensor> decay, no_decay;
  for (auto& p : reference->parameters()) (p.dim() >= 2 ? decay : no_decay).push_back(p);
  auto options = [&](double wd) {
    return std::make_unique<torch::optim::AdamWOptions>(
        torch::optim::AdamWOptions(c.lr).betas({c.beta1, c.beta2}).eps(1e-8).weight_decay(wd));
  };
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(decay, options(c.weight_decay));
  groups.emplace_back(no_decay, options(0.0));
  torch::optim::AdamW adam(groups, *options(c.weight_decay));

  for (int step = 0; step < 6; ++step) {
    const double lr = c.lr * (1.0 - 0.1 * step);  // a schedule, as training has
    for (auto& g : adam.param_groups()) static_cast<torch::optim::AdamWOptions&>(g.options()).lr(lr);
    inner.set_lr(lr);
    fill_gradients(reference->parameters(), step);
    fill_gradients(ours->parameters(), step);
    adam.step();
    inner.step();
  }
  EXPECT_EQ(inner.steps_taken(), 6);
  // Six steps of a changing lr: the moments are checked through the weights.
  const auto ref_params = reference->named_parameters();
  for (const auto& [name, p] : flat.named()) EXPECT_TRUE(bit_identical(p, ref_params[name])) << name;
}

// Saved after 3 steps and loaded into a fresh optimizer, 3 more steps land on
// the same weights as 6 uninterrupted ones.
TEST(InnerOptimizer, ResumesBitIdenticallyFromSavedState) {
  const auto c = adam_config();
  auto straight = make_model();
  FlatParams straight_flat(*straight);
  InnerOptimizer straight_inner(straight_flat, c, 100);
  for (int step = 0; step < 6; ++step) {
    fill_gradients(straight->parameters(), step);
    straight_inner.step();
  }

  auto first = make_model();
  FlatParams first_flat(*first);
  InnerOptimizer first_inner(first_flat, c, 100);
  for (int step = 0; step < 3; ++step) {
    fill_gradients(first->parameters(), step);
    first_inner.step();
  }
  TensorMap state;
  first_inner.save(state);
  for (auto& [name, t] : state) t = t.clone();  // what a checkpoint holds: copies

  auto resumed = make_model();
  FlatParams resumed_flat(*resumed);
  resumed_flat.values().copy_(first_flat.values());
  InnerOptimizer resumed_inner(resumed_flat, c, 64);  // chunking is not state
  resumed_inner.load(state, first_inner.steps_taken());
  for (int step = 3; step < 6; ++step) {
    fill_gradients(resumed->parameters(), step);
    resumed_inner.step();
  }
  EXPECT_TRUE(bit_identical(resumed_flat.values(), straight_flat.values()));
}

TEST(InnerOptimizer, RefusesStateOfTheWrongShape) {
  const auto c = adam_config();
  auto m = make_model();
  FlatParams flat(*m);
  InnerOptimizer inner(flat, c);
  fill_gradients(m->parameters(), 0);
  inner.step();
  TensorMap state;
  inner.save(state);
  state.at("adam.exp_avg.lm_head.weight") = torch::zeros({2, 2});
  InnerOptimizer other(flat, c);
  EXPECT_THROW(other.load(state, 1), c10::Error);
  state.erase("adam.exp_avg.lm_head.weight");
  EXPECT_THROW(other.load(state, 1), c10::Error);
}
