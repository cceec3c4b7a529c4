#include "model/llama.h"

#include "util/torch_shim.h"

namespace noloco {

namespace nn = torch::nn;

RMSNormImpl::RMSNormImpl(int64_t dim, double eps_) : eps(eps_) {
  weight = register_parameter("weight", torch::ones({dim}));
}

torch::Tensor RMSNormImpl::forward(const torch::Tensor& x) { return shim::rms_norm(x, weight, eps); }

RotaryTables rotary_tables(int64_t context, const std::vector<double>& inverse_frequencies,
                           torch::TensorOptions options) {
  auto f64 = torch::TensorOptions().dtype(torch::kFloat64);
  auto inv_freq = torch::tensor(inverse_frequencies, f64);
  auto freqs = torch::outer(torch::arange(context, f64), inv_freq);
  auto emb = torch::cat({freqs, freqs}, -1);
  auto dtype = options.has_dtype() ? options.dtype() : caffe2::TypeMeta::Make<float>();
  auto out = torch::TensorOptions().dtype(dtype).device(options.device());
  return {emb.cos().to(out), emb.sin().to(out)};
}

torch::Tensor apply_rotary(const torch::Tensor& x, const RotaryTables& rope) {
  const auto T = x.size(-2), half = x.size(-1) / 2;
  // In the activations' dtype, as Hugging Face does: under bf16 autocast q and k
  // stay bf16 instead of being promoted to fp32 and cast back for attention.
  auto cos = rope.cos.narrow(0, 0, T).to(x.scalar_type()), sin = rope.sin.narrow(0, 0, T).to(x.scalar_type());
  auto rotated = torch::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
  return x * cos + rotated * sin;
}

static nn::Linear linear(int64_t in, int64_t out) {
  return nn::Linear(nn::LinearOptions(in, out).bias(false));
}

AttentionImpl::AttentionImpl(const ModelConfig& c)
    : heads(c.heads), kv_heads(c.key_value_heads()), head_dim(c.head_dim()) {
  q_proj = register_module("q_proj", linear(c.hidden, heads * head_dim));
  k_proj = register_module("k_proj", linear(c.hidden, kv_heads * head_dim));
  v_proj = register_module("v_proj", linear(c.hidden, kv_heads * head_dim));
  o_proj = register_module("o_proj", linear(heads * head_dim, c.hidden));
}

torch::Tensor AttentionImpl::forward(const torch::Tensor& x, const RotaryTables& rope) {
  const auto B = x.size(0), T = x.size(1);
  auto split = [&](const torch::Tensor& t, int64_t n) { return t.view({B, T, n, head_dim}).transpose(1, 2); };
  // Grouped-query attention: each key/value head serves heads/kv_heads
  // consecutive query heads (HF's repeat_kv).
  auto share = [&](const torch::Tensor& t) {
    return kv_heads == heads ? t : t.repeat_interleave(heads / kv_heads, 1);
  };
  auto q = apply_rotary(split(q_proj(x), heads), rope);
  auto k = share(apply_rotary(split(k_proj(x), kv_heads), rope));
  auto v = share(split(v_proj(x), kv_heads));
  auto y = shim::causal_attention(q, k, v);
  return o_proj(y.transpose(1, 2).reshape({B, T, heads * head_dim}));
}

MLPImpl::MLPImpl(const ModelConfig& c) {
  gate_proj = register_module("gate_proj", linear(c.hidden, c.intermediate_size()));
  up_proj = register_module("up_proj", linear(c.hidden, c.intermediate_size()));
  down_proj = register_module("down_proj", linear(c.intermediate_size(), c.hidden));
}

torch::Tensor MLPImpl::forward(const torch::Tensor& x) {
  return down_proj(torch::silu(gate_proj(x)) * up_proj(x));
}

DecoderLayerImpl::DecoderLayerImpl(const ModelConfig& c) {
  self_attn = register_module("self_attn", Attention(c));
  mlp = register_module("mlp", MLP(c));
  input_layernorm = register_module("input_layernorm", RMSNorm(c.hidden, c.norm_eps));
  post_attention_layernorm =
      register_module("post_attention_layernorm", RMSNorm(c.hidden, c.norm_eps));
}

torch::Tensor DecoderLayerImpl::forward(const torch::Tensor& x, const RotaryTables& rope) {
  auto h = x + self_attn(input_layernorm(x), rope);
  return h + mlp(post_attention_layernorm(h));
}

LlamaBodyImpl::LlamaBodyImpl(const ModelConfig& c) {
  embed_tokens = register_module("embed_tokens", nn::Embedding(c.vocab_size, c.hidden));
  layers = register_module("layers", nn::ModuleList());
  for (int64_t i = 0; i < c.layers; ++i) layers->push_back(DecoderLayer(c));
  norm = register_module("norm", RMSNorm(c.hidden, c.norm_eps));
}

LlamaForCausalLMImpl::LlamaForCausalLMImpl(const ModelConfig& c) : config(c) {
  config.validate();
  model = register_module("model", LlamaBody(config));
  if (!config.tied_embeddings) lm_head = register_module("lm_head", linear(config.hidden, config.vocab_size));
}

torch::Tensor vocabulary_logits(const torch::Tensor& normed, torch::nn::Linear lm_head,
                                torch::nn::Embedding embed_tokens) {
  if (lm_head) return lm_head(normed);
  TORCH_CHECK(embed_tokens, "tied embeddings: the output layer needs the embedding matrix");
  return torch::nn::functional::linear(normed, embed_tokens->weight);
}

torch::Tensor LlamaForCausalLMImpl::head(const torch::Tensor& normed) {
  return vocabulary_logits(normed, lm_head, model->embed_tokens);
}

const RotaryTables& cached_rotary_tables(RotaryTables& cache, const ModelConfig& c, const torch::Tensor& like) {
  if (!cache.cos.defined() || cache.cos.device() != like.device() || cache.cos.scalar_type() != like.scalar_type()) {
    cache = rotary_tables(c.context, c.rope_inverse_frequencies(),
                          torch::TensorOptions().dtype(like.scalar_type()).device(like.device()));
  }
  return cache;
}

const RotaryTables& LlamaForCausalLMImpl::rope(const torch::Tensor& like) {
  return cached_rotary_tables(rope_, config, like);
}

torch::Tensor LlamaForCausalLMImpl::forward(const torch::Tensor& tokens) {
  TORCH_CHECK(tokens.size(1) <= config.context, "sequence length ", tokens.size(1),
              " exceeds the model context ", config.context);
  auto x = model->embed_tokens(tokens);
  const auto& tables = rope(x);
  for (const auto& layer : *model->layers) x = layer->as<DecoderLayer>()->forward(x, tables);
  return head(model->norm(x));
}

torch::Tensor next_token_loss(const torch::Tensor& logits, const torch::Tensor& targets) {
  // At least fp32 for the softmax, without dropping double precision in tests.
  const auto dtype = at::promote_types(logits.scalar_type(), torch::kFloat32);
  return torch::nn::functional::cross_entropy(logits.reshape({-1, logits.size(-1)}).to(dtype),
                                              targets.reshape({-1}));
}

torch::Tensor LlamaForCausalLMImpl::loss(const torch::Tensor& tokens,
                                         const torch::Tensor& targets) {
  return next_token_loss(forward(tokens), targets);
}

void init_weights(LlamaForCausalLM& model, uint64_t seed) {
  torch::NoGradGuard no_grad;
  auto gen = at::detail::createCPUGenerator(seed);
  for (auto& p : model->named_parameters()) {
    auto& t = p.value();
    if (t.dim() == 1) {
      t.fill_(1.0);
    } else {
      // Sample on the CPU with our own generator so every device gets the same weights.
      auto cpu = at::empty(t.sizes(), torch::kFloat32);
      cpu.normal_(0.0, 0.02, gen);
      t.copy_(cpu);
    }
  }
}

}  // namespace noloco
