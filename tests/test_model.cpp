#include <gtest/gtest.h>

#include <cmath>
#include <map>

#include <fmt/format.h>
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

// A model whose heads are not hidden/heads wide (head_dim given, as
// config.json may) and whose output layer is its embedding matrix
// (tie_word_embeddings), against a forward pass written here from the
// Llama equations with plain tensor operations, in double.
TEST(Model, ExplicitHeadDimAndTiedEmbeddingsMatchAnIndependentForward) {
  auto c = small_config(2);  // 4 query heads, 2 key/value heads
  c.head_size = 6;           // 4 x 6 = 24 wide attention in an 8-wide model
  c.tied_embeddings = true;
  auto m = make_model(c, torch::kFloat64);
  auto p = m->named_parameters();
  EXPECT_FALSE(p.contains("lm_head.weight"));
  EXPECT_EQ(p["model.layers.0.self_attn.q_proj.weight"].sizes(), (std::vector<int64_t>{24, 8}));
  EXPECT_EQ(p["model.layers.0.self_attn.o_proj.weight"].sizes(), (std::vector<int64_t>{8, 24}));
  int64_t n = 0;
  for (auto& t : m->parameters()) n += t.numel();
  EXPECT_EQ(n, c.num_params());

  const auto tokens = torch::tensor({{1, 5, 2, 9, 3, 7}, {4, 4, 0, 10, 7, 2}}, torch::kInt64);
  const int64_t B = 2, T = 6, H = 4, KV = 2, D = 6;
  auto norm = [&](const torch::Tensor& x, const torch::Tensor& w) {
    return x / (x.square().mean(-1, true) + c.norm_eps).sqrt() * w;
  };
  auto rotate = [&](const torch::Tensor& x) {  // [B, heads, T, D], rotate_half pairing i with i + D/2
    auto out = torch::empty_like(x);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t i = 0; i < D / 2; ++i) {
        const double angle = double(t) * std::pow(c.rope_theta, -2.0 * double(i) / double(D));
        auto a = x.select(2, t).select(-1, i), b = x.select(2, t).select(-1, i + D / 2);
        out.select(2, t).select(-1, i).copy_(a * std::cos(angle) - b * std::sin(angle));
        out.select(2, t).select(-1, i + D / 2).copy_(b * std::cos(angle) + a * std::sin(angle));
      }
    return out;
  };
  auto x = p["model.embed_tokens.weight"].index_select(0, tokens.reshape({-1})).view({B, T, c.hidden});
  const auto causal = torch::ones({T, T}, torch::kBool).tril();
  for (int64_t l = 0; l < c.layers; ++l) {
    auto w = [&](const std::string& name) { return p[fmt::format("model.layers.{}.{}", l, name)]; };
    auto h = norm(x, w("input_layernorm.weight"));
    auto q = rotate(h.matmul(w("self_attn.q_proj.weight").t()).view({B, T, H, D}).transpose(1, 2));
    auto k = rotate(h.matmul(w("self_attn.k_proj.weight").t()).view({B, T, KV, D}).transpose(1, 2));
    auto v = h.matmul(w("self_attn.v_proj.weight").t()).view({B, T, KV, D}).transpose(1, 2);
    std::vector<torch::Tensor> heads;
    for (int64_t head = 0; head < H; ++head) {
      const int64_t shared = head / (H / KV);  // query heads 0,1 use key/value head 0; 2,3 use 1
      auto scores = q.select(1, head).matmul(k.select(1, shared).transpose(-1, -2)) / std::sqrt(double(D));
      scores = scores.masked_fill(causal.logical_not(), -INFINITY);
      heads.push_back(scores.softmax(-1).matmul(v.select(1, shared)));  // [B, T, D]
    }
    x = x + torch::cat(heads, -1).matmul(w("self_attn.o_proj.weight").t());
    h = norm(x, w("post_attention_layernorm.weight"));
    auto gate = h.matmul(w("mlp.gate_proj.weight").t());
    x = x + (gate * gate.sigmoid() * h.matmul(w("mlp.up_proj.weight").t())).matmul(w("mlp.down_proj.weight").t());
  }
  const auto expected = norm(x, p["model.norm.weight"]).matmul(p["model.embed_tokens.weight"].t());
  torch::NoGradGuard g;
  const double diff = (m->forward(tokens) - expected).abs().max().item<double>();
  EXPECT_LT(diff, 1e-10);
  EXPECT_GT(expected.abs().max().item<double>(), 1.0);  // the comparison sees real values
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
