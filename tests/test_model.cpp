#include <gtest/gtest.h>

#include <map>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "model/llama.h"

using namespace noloco;

namespace {

ModelConfig small_config(int64_t kv_heads = 0) {
  ModelConfig c;
  c.vocab_size = 11;
  c.hidden = 8;
  c.layers = 2;
  c.heads = kv_heads > 0 ? 4 : 2;
  c.kv_heads = kv_heads;
  c.intermediate = 16;
  c.context = 6;
  return c;
}

// Multi-head and grouped-query (4 query heads sharing 2 key/value heads).
const int64_t kKvHeadChoices[] = {0, 2};

LlamaForCausalLM make_model(const ModelConfig& c, torch::ScalarType dtype = torch::kFloat32) {
  LlamaForCausalLM m(c);
  init_weights(m, 7);
  // Larger weights than N(0, 0.02) so the finite-difference check sees real curvature.
  torch::NoGradGuard g;
  for (auto& p : m->parameters())
    if (p.dim() == 2) p.mul_(10);
  m->to(dtype);
  return m;
}

}  // namespace

TEST(Model, LogitShapeAndParameterCount) {
  for (auto kv : kKvHeadChoices) {
    auto c = small_config(kv);
    auto m = make_model(c);
    auto tokens = torch::randint(c.vocab_size, {3, 5}, torch::kInt64);
    auto logits = m->forward(tokens);
    EXPECT_EQ(logits.sizes(), (std::vector<int64_t>{3, 5, 11}));
    int64_t n = 0;
    for (auto& p : m->parameters()) n += p.numel();
    EXPECT_EQ(n, c.num_params());
  }
}

TEST(Model, ParameterNamesAreHuggingFaceLlama) {
  for (auto kv : kKvHeadChoices) {
    auto c = small_config(kv);
    auto m = make_model(c);
    auto named = m->named_parameters();
    const auto expected = c.parameter_shapes();
    ASSERT_EQ(named.size(), expected.size());
    for (size_t i = 0; i < expected.size(); ++i) {
      EXPECT_EQ(named[i].key(), expected[i].first);
      EXPECT_EQ(named[i].value().sizes(), c10::IntArrayRef(expected[i].second));
    }
    EXPECT_EQ(expected.front().first, "model.embed_tokens.weight");
    EXPECT_EQ(expected[1].first, "model.layers.0.self_attn.q_proj.weight");
    EXPECT_EQ(expected[2].second, (std::vector<int64_t>{c.key_value_heads() * c.head_dim(), c.hidden}));
    EXPECT_EQ(expected.back().first, "lm_head.weight");
  }
}

TEST(Model, CausalityFutureTokensDoNotChangeEarlierLogits) {
  for (auto kv : kKvHeadChoices) {
    auto c = small_config(kv);
    auto m = make_model(c);
    torch::NoGradGuard g;
    auto a = torch::tensor({{1, 2, 3, 4, 5, 6}}, torch::kInt64);
    auto b = a.clone();
    b[0][4] = 9;
    auto la = m->forward(a), lb = m->forward(b);
    EXPECT_TRUE(torch::allclose(la.narrow(1, 0, 4), lb.narrow(1, 0, 4), 0, 1e-6)) << "kv_heads " << kv;
    EXPECT_GT((la.narrow(1, 4, 2) - lb.narrow(1, 4, 2)).abs().max().item<double>(), 1e-4);
  }
}

// Grouped-query attention is multi-head attention whose key/value heads are
// repeated across their group: copy a GQA model's weights into a multi-head
// model with each k/v head's rows repeated, and the logits must agree.
TEST(Model, GroupedQueryAttentionEqualsMultiHeadWithRepeatedKeyValueHeads) {
  auto gqa_config = small_config(2);
  auto gqa = make_model(gqa_config, torch::kFloat64);
  auto mha_config = gqa_config;
  mha_config.kv_heads = 0;
  LlamaForCausalLM mha(mha_config);
  mha->to(torch::kFloat64);
  {
    torch::NoGradGuard g;
    const auto group = gqa_config.heads / gqa_config.kv_heads, d = gqa_config.head_dim();
    auto source = gqa->named_parameters();
    for (auto& p : mha->named_parameters()) {
      auto w = source[p.key()];
      const bool kv = p.key().find("k_proj") != std::string::npos || p.key().find("v_proj") != std::string::npos;
      if (kv) w = w.view({gqa_config.kv_heads, d, -1}).repeat_interleave(group, 0).reshape(p.value().sizes());
      p.value().copy_(w);
    }
  }
  auto tokens = torch::tensor({{1, 5, 2, 9, 3, 7}, {4, 4, 0, 10, 7, 2}}, torch::kInt64);
  torch::NoGradGuard g;
  const double diff = (gqa->forward(tokens) - mha->forward(tokens)).abs().max().item<double>();
  EXPECT_LT(diff, 1e-12);
  EXPECT_THROW(LlamaForCausalLM([&] {
                 auto bad = gqa_config;
                 bad.kv_heads = 3;
                 return bad;
               }()),
               std::invalid_argument);
}

TEST(Model, RotaryMatchesHandComputedValues) {
  // head_dim 4, theta 10000: inverse frequencies 1 and 0.01; position 1.
  ModelConfig c;
  c.hidden = 4, c.heads = 1, c.rope_theta = 10000.0;
  ASSERT_EQ(c.rope_inverse_frequencies(), (std::vector<double>{1.0, 0.01}));
  auto rope = rotary_tables(2, c.rope_inverse_frequencies(), torch::TensorOptions().dtype(torch::kFloat64));
  auto x = torch::tensor({1.0, 2.0, 3.0, 4.0}, torch::kFloat64).view({1, 1, 1, 4}).repeat({1, 1, 2, 1});
  auto y = apply_rotary(x, rope);
  const double c1 = std::cos(1.0), s1 = std::sin(1.0), c2 = std::cos(0.01), s2 = std::sin(0.01);
  // rotate_half([1,2,3,4]) = [-3,-4,1,2]
  const double expected[4] = {1 * c1 - 3 * s1, 2 * c2 - 4 * s2, 3 * c1 + 1 * s1, 4 * c2 + 2 * s2};
  for (int i = 0; i < 4; ++i) {
    EXPECT_NEAR(y[0][0][1][i].item<double>(), expected[i], 1e-12) << i;
    EXPECT_NEAR(y[0][0][0][i].item<double>(), x[0][0][0][i].item<double>(), 1e-12);  // position 0: identity
  }
}

// Llama 3.2 1B's rope_scaling (type llama3, factor 32, low_freq_factor 1,
// high_freq_factor 4, original_max_position_embeddings 8192, rope_theta
// 500000, head_dim 64). Expected values computed apart from this code (a
// Python transcription of Meta's published apply_scaling): wavelengths under
// 8192/4 are kept, over 8192/1 divided by 32, and the three frequencies
// between interpolated. Tolerance: 1e-12 relative.
TEST(Model, Llama3RopeScalingMatchesIndependentValues) {
  ModelConfig c;
  c.hidden = 64 * 32, c.heads = 32, c.rope_theta = 500000.0;
  c.rope_scaling = RopeScaling{"llama3", 32.0, 1.0, 4.0, 8192};
  const auto inv = c.rope_inverse_frequencies();
  ASSERT_EQ(inv.size(), 32u);
  const std::map<int, double> expected = {{0, 1.0},
                                          {14, 0.003211445994752591},
                                          {15, 0.001290547928209264},
                                          {16, 0.00042955679655936815},
                                          {17, 9.70828780262767e-05},
                                          {18, 1.9461638184831125e-05},
                                          {31, 9.41830672543491e-08}};
  for (const auto& [i, v] : expected) EXPECT_NEAR(inv[size_t(i)] / v, 1.0, 1e-12) << i;
  // linear: every frequency divided by the factor.
  c.rope_scaling = RopeScaling{"linear", 4.0};
  EXPECT_NEAR(c.rope_inverse_frequencies()[0], 0.25, 1e-15);
  // It travels through checkpoints' metadata and config.json.
  c.vocab_size = 10, c.layers = 1;
  c.rope_scaling = RopeScaling{"llama3", 32.0, 1.0, 4.0, 8192};
  EXPECT_EQ(ModelConfig::from_json(c.to_json()).rope_scaling, c.rope_scaling);
  EXPECT_EQ(ModelConfig::from_hf_json(c.to_hf_json()).rope_scaling, c.rope_scaling);
}

TEST(Model, RMSNormMatchesHandComputedValues) {
  RMSNorm norm(2, 1e-6);
  auto y = norm->forward(torch::tensor({{3.0f, 4.0f}}));
  const double rms = std::sqrt((9.0 + 16.0) / 2.0 + 1e-6);
  EXPECT_NEAR(y[0][0].item<double>(), 3.0 / rms, 1e-6);
  EXPECT_NEAR(y[0][1].item<double>(), 4.0 / rms, 1e-6);
}

class ModelGradient : public ::testing::TestWithParam<int64_t> {};

TEST_P(ModelGradient, MatchesFiniteDifferencesInDouble) {
  auto c = small_config(GetParam());
  c.layers = 1;
  auto m = make_model(c, torch::kFloat64);
  auto tokens = torch::tensor({{1, 5, 2, 9, 3}, {4, 4, 0, 10, 7}}, torch::kInt64);
  auto targets = torch::tensor({{5, 2, 9, 3, 1}, {4, 0, 10, 7, 6}}, torch::kInt64);
  m->zero_grad();
  m->loss(tokens, targets).backward();
  const double h = 1e-6;
  int checked = 0;
  double worst = 0;
  for (auto& p : m->named_parameters()) {
    auto flat = p.value().data().view(-1);
    auto grad = p.value().grad().view(-1);
    for (int64_t i = 0; i < flat.numel(); i += 3) {  // every third entry of every tensor
      torch::NoGradGuard g;
      const double orig = flat[i].item<double>();
      flat[i] = orig + h;
      const double up = m->loss(tokens, targets).item<double>();
      flat[i] = orig - h;
      const double down = m->loss(tokens, targets).item<double>();
      flat[i] = orig;
      const double numeric = (up - down) / (2 * h);
      const double analytic = grad[i].item<double>();
      const double err = std::abs(numeric - analytic) / std::max(1e-3, std::abs(numeric) + std::abs(analytic));
      worst = std::max(worst, err);
      EXPECT_LT(err, 1e-5) << p.key() << "[" << i << "] numeric " << numeric << " analytic " << analytic;
      ++checked;
    }
  }
  EXPECT_GT(checked, 100);
  RecordProperty("worst_relative_error", std::to_string(worst));
}

INSTANTIATE_TEST_SUITE_P(Model, ModelGradient, ::testing::ValuesIn(kKvHeadChoices),
                         [](const auto& info) { return info.param > 0 ? std::string("GroupedQuery") : std::string("MultiHead"); });

TEST(Model, ConfigValidationNamesTheProblem) {
  auto c = small_config();
  c.heads = 3;
  try {
    c.validate();
    FAIL() << "heads not dividing hidden must be rejected";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("heads (3) must divide hidden (8)"), std::string::npos);
  }
  EXPECT_THROW(model_preset("7b"), std::invalid_argument);
  EXPECT_EQ(model_preset("125m").hidden, 768);
  EXPECT_EQ(model_preset("1.3b").layers, 24);
  EXPECT_EQ(model_preset("6.8b").intermediate, 16384);
}
