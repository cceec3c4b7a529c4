// Decoder-only Llama with the math and parameter names of Hugging Face's
// LlamaForCausalLM, so named_parameters() is already the export layout.
#pragma once
#include <torch/torch.h>

#include "config/model_config.h"

namespace noloco {

struct RMSNormImpl : torch::nn::Module {
  RMSNormImpl(int64_t dim, double eps);
  torch::Tensor forward(const torch::Tensor& x);
  torch::Tensor weight;
  double eps;
};
TORCH_MODULE(RMSNorm);

// cos/sin tables [context, head_dim] in HF's rotate_half layout
// (frequencies repeated twice, not interleaved).
struct RotaryTables {
  torch::Tensor cos, sin;
};
RotaryTables rotary_tables(int64_t context, const std::vector<double>& inverse_frequencies,
                           torch::TensorOptions options = {});
// `cache` refilled for c's tables only when `like`'s device or dtype changes.
const RotaryTables& cached_rotary_tables(RotaryTables& cache, const ModelConfig& c, const torch::Tensor& like);
// x: [B, heads, T, head_dim]; x·cos + rotate_half(x)·sin.
torch::Tensor apply_rotary(const torch::Tensor& x, const RotaryTables& rope);

struct AttentionImpl : torch::nn::Module {
  explicit AttentionImpl(const ModelConfig& c);
  torch::Tensor forward(const torch::Tensor& x, const RotaryTables& rope);
  torch::nn::Linear q_proj{nullptr}, k_proj{nullptr}, v_proj{nullptr}, o_proj{nullptr};
  int64_t heads, kv_heads, head_dim;
};
TORCH_MODULE(Attention);

struct MLPImpl : torch::nn::Module {
  explicit MLPImpl(const ModelConfig& c);
  torch::Tensor forward(const torch::Tensor& x);
  torch::nn::Linear gate_proj{nullptr}, up_proj{nullptr}, down_proj{nullptr};
};
TORCH_MODULE(MLP);

struct DecoderLayerImpl : torch::nn::Module {
  explicit DecoderLayerImpl(const ModelConfig& c);
  torch::Tensor forward(const torch::Tensor& x, const RotaryTables& rope);
  RMSNorm input_layernorm{nullptr}, post_attention_layernorm{nullptr};
  Attention self_attn{nullptr};
  MLP mlp{nullptr};
};
TORCH_MODULE(DecoderLayer);

// The "model." prefix of HF names: embeddings, layers, final norm.
struct LlamaBodyImpl : torch::nn::Module {
  explicit LlamaBodyImpl(const ModelConfig& c);
  torch::nn::Embedding embed_tokens{nullptr};
  torch::nn::ModuleList layers{nullptr};
  RMSNorm norm{nullptr};
};
TORCH_MODULE(LlamaBody);

struct LlamaForCausalLMImpl : torch::nn::Module {
  explicit LlamaForCausalLMImpl(const ModelConfig& c);
  // tokens: [B, T] int64 -> logits [B, T, vocab].
  torch::Tensor forward(const torch::Tensor& tokens);
  // Mean next-token cross-entropy.
  torch::Tensor loss(const torch::Tensor& tokens, const torch::Tensor& targets);
  // Logits [B, T, vocab] of final-norm hidden states.
  torch::Tensor head(const torch::Tensor& normed);
  // Rotary tables for the model's device and dtype, cached.
  const RotaryTables& rope(const torch::Tensor& like);

  ModelConfig config;
  LlamaBody model{nullptr};
  torch::nn::Linear lm_head{nullptr};  // none with tied embeddings

 private:
  RotaryTables rope_;
};
TORCH_MODULE(LlamaForCausalLM);

// The output layer: `lm_head`, or with tied embeddings (no lm_head) the embedding matrix.
torch::Tensor vocabulary_logits(const torch::Tensor& normed, torch::nn::Linear lm_head,
                                torch::nn::Embedding embed_tokens);

// Mean next-token cross-entropy of logits [B, T, vocab] against targets [B, T],
// with the softmax in at least fp32.
torch::Tensor next_token_loss(const torch::Tensor& logits, const torch::Tensor& targets);

// Hugging Face's initialisation: N(0, 0.02) for linear and embedding weights, ones for norms.
void init_weights(LlamaForCausalLM& model, uint64_t seed);

}  // namespace noloco
