// Shape of a Llama model; torch-free so configs and checkpoints can use it cheaply.
#pragma once
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json_fwd.hpp>

namespace noloco {

// Rotary frequencies stretched for long contexts, as config.json's rope_scaling says.
struct RopeScaling {
  std::string type = "none";  // none | linear (every frequency / factor) | llama3 (Llama 3.1+'s banded rule)
  double factor = 1.0;
  double low_freq_factor = 1.0, high_freq_factor = 4.0;  // llama3
  int64_t original_context = 8192;                       // llama3: original_max_position_embeddings
  bool operator==(const RopeScaling& o) const {
    return type == o.type && factor == o.factor && low_freq_factor == o.low_freq_factor &&
           high_freq_factor == o.high_freq_factor && original_context == o.original_context;
  }
};

struct ModelConfig {
  int64_t vocab_size = 0;  // set from the tokenizer when 0
  int64_t hidden = 128;
  int64_t layers = 4;
  int64_t heads = 4;
  int64_t kv_heads = 0;  // key/value heads (grouped-query attention); 0: heads
  int64_t head_size = 0;  // width of one attention head (config.json's head_dim); 0: hidden / heads
  int64_t intermediate = 0;  // 0: Llama's rule, about 8/3 · hidden rounded up to 64
  int64_t context = 64;
  double rope_theta = 10000.0;
  double norm_eps = 1e-5;
  RopeScaling rope_scaling;
  // The output layer is the embedding matrix (tie_word_embeddings): no lm_head.weight of its own.
  bool tied_embeddings = false;

  int64_t head_dim() const { return head_size > 0 ? head_size : hidden / heads; }
  int64_t key_value_heads() const { return kv_heads > 0 ? kv_heads : heads; }
  int64_t intermediate_size() const;
  // The rotary inverse frequencies theta^(-2i/head_dim), i < head_dim/2, after rope_scaling.
  std::vector<double> rope_inverse_frequencies() const;
  // Hugging Face parameter names and shapes, in registration order.
  std::vector<std::pair<std::string, std::vector<int64_t>>> parameter_shapes() const;
  int64_t num_params() const;
  // Training FLOPs per token (forward + backward), as in the PaLM appendix:
  // 6·N for the matmuls plus 6·layers·T·hidden for attention scores.
  double train_flops_per_token() const;
  // Throws std::invalid_argument naming the first bad field.
  void validate() const;

  nlohmann::json to_json() const;
  static ModelConfig from_json(const nlohmann::json& j);
  // Hugging Face LlamaConfig (config.json) for export.
  nlohmann::json to_hf_json() const;
  // A LlamaForCausalLM config.json: context is max_position_embeddings.
  // Throws std::invalid_argument naming the key of anything this model does
  // not implement (rope_scaling, biases, another architecture...).
  static ModelConfig from_hf_json(const nlohmann::json& j);
};

// A Hugging Face directory's config.json; throws std::invalid_argument naming
// the directory and the key it cannot take.
ModelConfig read_hf_config(const std::string& dir);

// "tiny" (Shakespeare), and the paper's "125m", "1.3b", "6.8b".
// Throws std::invalid_argument for an unknown name.
ModelConfig model_preset(const std::string& name);

}  // namespace noloco
