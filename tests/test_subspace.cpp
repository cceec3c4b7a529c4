// activation_subspace (issue 51): the shared basis, the exact rebuild of a
// boundary's hidden states from K coordinates a token, and the constraint
// that keeps every residual-stream write in the span through AdamW's steps.
#include <gtest/gtest.h>

#include <torch/torch.h>

#include "model/llama.h"
#include "model/subspace.h"
#include "optim/flat_params.h"
#include "optim/inner.h"
#include "optim/subspace_constraint.h"
#include "pipeline/stage.h"
#include "subspace_measures.h"
#include "util/files.h"

using namespace noloco;
using noloco::testing::outside_span;

namespace {

ModelConfig small_model() {
  ModelConfig c;
  c.vocab_size = 50;
  c.hidden = 32;
  c.layers = 2;
  c.heads = 2;
  c.kv_heads = 2;
  c.intermediate = 64;
  c.context = 16;
  c.tied_embeddings = false;
  return c;
}

bool constrained_name(const std::string& name) {
  return ends_with(name, "o_proj.weight") || ends_with(name, "down_proj.weight");
}

}  // namespace

TEST(ResidualSubspace, BasisIsOrthonormalAndEveryWorkerDerivesTheSameOne) {
  const auto u = subspace_basis(64, 16, 7);
  EXPECT_EQ(u.sizes(), (std::vector<int64_t>{64, 16}));
  EXPECT_LT((u.t().matmul(u) - torch::eye(16)).abs().max().item<double>(), 1e-6);
  EXPECT_TRUE(torch::equal(u, subspace_basis(64, 16, 7))) << "a pure function of the seed";
  EXPECT_FALSE(torch::allclose(u, subspace_basis(64, 16, 8)));
  EXPECT_THROW(subspace_basis(8, 9, 7), std::invalid_argument);
  EXPECT_THROW(subspace_basis(8, 0, 7), std::invalid_argument);
}

// h = F[ids] + U·z with F ⟂ U: the coordinates alone rebuild h (fp32 rounding).
TEST(ResidualSubspace, CoordinatesAndTokenIdsRebuildTheResidualStream) {
  torch::manual_seed(0);
  const auto embedding = torch::randn({50, 32});
  const ResidualSubspace s(8, 3, embedding, 0);
  const auto fixed = embedding - embedding.matmul(s.basis()).matmul(s.basis().t());
  EXPECT_LT(fixed.matmul(s.basis()).abs().max().item<double>(), 1e-5) << "the frozen part is orthogonal to U";
  const auto ids = torch::randint(50, {3, 5}, torch::kInt64);
  const auto z = torch::randn({3, 5, 8});
  const auto h = fixed.index_select(0, ids.reshape({-1})).view({3, 5, 32}) + z.matmul(s.basis().t());
  EXPECT_LT((s.coordinates(h) - z).abs().max().item<double>(), 1e-5);
  EXPECT_LT((s.residual(s.coordinates(h), ids) - h).abs().max().item<double>(), 1e-5);
  const auto g = torch::randn({3, 5, 32});
  const auto projected = s.span_vector(s.coordinates(g));
  EXPECT_LT((s.coordinates(projected) - s.coordinates(g)).abs().max().item<double>(), 1e-5);
  EXPECT_GT((projected - g).abs().max().item<double>(), 0.1) << "a gradient loses what lies outside the span";
  // The frozen part scaled (here to node0's standard deviation 1), still orthogonal to U.
  const ResidualSubspace scaled(8, 3, embedding * 0.02, 0, /*frozen_std=*/1.0);
  const auto unit = scaled.residual(torch::zeros({50, 1, 8}), torch::arange(50).view({50, 1})).view({50, 32});
  EXPECT_NEAR(unit.std().item<double>(), 1.0, 1e-4);
  EXPECT_LT(unit.matmul(scaled.basis()).abs().max().item<double>(), 1e-4);
}

// The training loop's order (model/subspace.h, optim/subspace_constraint.h):
// gradients projected, AdamW's step, weights projected. After every step the
// writers stay in span(U) to 1e-6, the embedding's part outside the span is
// still its initial one, and AdamW's first moment lies in the span; without
// the weight projection the step would have left it.
TEST(SubspaceConstraint, InnerStepsKeepTheWritersInTheSpanAndTheEmbeddingsFrozenPart) {
  LlamaForCausalLM model(small_model());
  init_weights(model, 5);
  const auto e0 = model->model->embed_tokens->weight.detach().clone();
  auto subspace = std::make_shared<const ResidualSubspace>(4, 5, e0, /*constrained_layers=*/2);
  const auto& u = subspace->basis();
  FlatParams flat(*model);
  const auto constraint = std::make_shared<const SubspaceConstraint>(subspace, flat);
  EXPECT_EQ(constraint->constrained(), 5u) << "2 layers x (o_proj, down_proj) and the embedding";
  EXPECT_EQ(SubspaceConstraint(std::make_shared<const ResidualSubspace>(4, 5, e0, 1), flat).constrained(), 3u)
      << "a last stage's layers write freely";
  flat.constrain(constraint);
  for (const auto& [name, t] : flat.named())
    if (constrained_name(name)) EXPECT_LT(outside_span(t, u), 1e-6) << name << ": projected when constrained";
  EXPECT_LT((model->model->embed_tokens->weight - e0).abs().max().item<double>(), 1e-6)
      << "the embedding starts as it was: its frozen part is E0's";

  InnerConfig c;
  c.lr = 1e-2;
  c.weight_decay = 0.1;
  InnerOptimizer adam(flat, c);
  torch::manual_seed(1);
  const auto frozen = [&](const torch::Tensor& e) { return e - e.matmul(u).matmul(u.t()); };
  for (int step = 0; step < 3; ++step) {
    flat.grads().zero_();
    const auto tokens = torch::randint(50, {2, 16}, torch::kInt64);
    model->loss(tokens, torch::randint(50, {2, 16}, torch::kInt64)).backward();
    flat.project_change(flat.grads());
    adam.clip_gradients(1.0);
    adam.step();
    if (step == 2) {
      const auto before = flat.values().clone();
      flat.project_weights(flat.values());
      EXPECT_GT((flat.values() - before).abs().max().item<double>(), 1e-7) << "AdamW's step leans out of the span";
    } else {
      flat.project_weights(flat.values());
    }
    for (const auto& [name, t] : flat.named())
      if (constrained_name(name)) EXPECT_LT(outside_span(t, u), 1e-6) << name << " after step " << step;
    EXPECT_LT((frozen(model->model->embed_tokens->weight) - frozen(e0)).abs().max().item<double>(), 1e-6)
        << "weight decay and AdamW leave the frozen part alone, step " << step;
  }
  TensorMap state;
  adam.save(state);
  for (const auto& [name, t] : flat.named())
    if (constrained_name(name))
      EXPECT_LT(outside_span(state.at("adam.exp_avg." + name).view(t.sizes()), u), 1e-6) << name;
}

// Two stages of a constrained model: what a subspace boundary carries (h
// rebuilt from K coordinates and the token ids; the gradient projected onto
// the span) gives the loss and every parameter gradient of the uncompressed
// boundary, once the constrained matrices' gradients are projected as the
// training loop does: the subspace code loses nothing.
TEST(ResidualSubspace, ABoundaryOfKCoordinatesGivesTheUncompressedGradients) {
  LlamaForCausalLM whole(small_model());
  init_weights(whole, 9);
  auto subspace = std::make_shared<const ResidualSubspace>(4, 9, whole->model->embed_tokens->weight, 1);
  FlatParams flat(*whole);
  flat.constrain(std::make_shared<const SubspaceConstraint>(subspace, flat));
  StageModule first(whole, LayerRange{0, 1}, true, false), last(whole, LayerRange{1, 2}, false, true);
  torch::manual_seed(2);
  const auto ids = torch::randint(50, {2, 16}, torch::kInt64), targets = torch::randint(50, {2, 16}, torch::kInt64);
  const auto gradients = [&](bool compressed) {
    flat.grads().zero_();
    auto h = first->forward(ids);
    auto received = compressed ? subspace->residual(subspace->coordinates(h.detach()), ids) : h.detach();
    received.requires_grad_(true);
    const auto loss = next_token_loss(last->forward(received), targets);
    loss.backward();
    const auto g = received.grad();
    h.backward(compressed ? subspace->span_vector(subspace->coordinates(g)) : g);
    flat.project_change(flat.grads());
    return std::make_pair(loss.item<double>(), flat.grads().clone());
  };
  const auto [exact_loss, exact] = gradients(false);
  const auto [coded_loss, coded] = gradients(true);
  EXPECT_NEAR(coded_loss, exact_loss, 1e-5);
  EXPECT_LT((coded - exact).abs().max().item<double>(), 1e-5 * exact.abs().max().item<double>());
  EXPECT_GT(exact.abs().max().item<double>(), 1e-3);
}
