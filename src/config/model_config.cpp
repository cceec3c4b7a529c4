#include "config/model_config.h"

#include <stdexcept>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

namespace noloco {

int64_t ModelConfig::intermediate_size() const {
  if (intermediate > 0) return intermediate;
  const int64_t raw = (8 * hidden) / 3;
  return (raw + 63) / 64 * 64;
}

std::vector<std::pair<std::string, std::vector<int64_t>>> ModelConfig::parameter_shapes() const {
  const int64_t h = hidden, f = intermediate_size();
  std::vector<std::pair<std::string, std::vector<int64_t>>> shapes = {{"model.embed_tokens.weight", {vocab_size, h}}};
  for (int64_t i = 0; i < layers; ++i) {
    const auto l = fmt::format("model.layers.{}.", i);
    for (auto proj : {"q_proj", "k_proj", "v_proj", "o_proj"})
      shapes.push_back({l + "self_attn." + proj + ".weight", {h, h}});
    shapes.push_back({l + "mlp.gate_proj.weight", {f, h}});
    shapes.push_back({l + "mlp.up_proj.weight", {f, h}});
    shapes.push_back({l + "mlp.down_proj.weight", {h, f}});
    shapes.push_back({l + "input_layernorm.weight", {h}});
    shapes.push_back({l + "post_attention_layernorm.weight", {h}});
  }
  shapes.push_back({"model.norm.weight", {h}});
  shapes.push_back({"lm_head.weight", {vocab_size, h}});
  return shapes;
}

int64_t ModelConfig::num_params() const {
  int64_t n = 0;
  for (auto& [name, shape] : parameter_shapes()) {
    int64_t k = 1;
    for (auto d : shape) k *= d;
    n += k;
  }
  return n;
}

double ModelConfig::train_flops_per_token() const {
  const double non_embedding = double(num_params() - vocab_size * hidden);
  return 6.0 * non_embedding + 6.0 * double(layers) * double(context) * double(hidden);
}

void ModelConfig::validate() const {
  auto fail = [](const std::string& m) { throw std::invalid_argument(m); };
  if (vocab_size <= 0) fail(fmt::format("vocab_size must be positive, got {}", vocab_size));
  if (hidden <= 0) fail(fmt::format("hidden must be positive, got {}", hidden));
  if (layers <= 0) fail(fmt::format("layers must be positive, got {}", layers));
  if (heads <= 0) fail(fmt::format("heads must be positive, got {}", heads));
  if (hidden % heads != 0)
    fail(fmt::format("heads ({}) must divide hidden ({})", heads, hidden));
  if (head_dim() % 2 != 0)
    fail(fmt::format("hidden/heads ({}) must be even for rotary embeddings", head_dim()));
  if (intermediate < 0) fail(fmt::format("intermediate must be >= 0, got {}", intermediate));
  if (context <= 0) fail(fmt::format("context must be positive, got {}", context));
  if (!(rope_theta > 0)) fail(fmt::format("rope_theta must be positive, got {}", rope_theta));
  if (!(norm_eps > 0)) fail(fmt::format("norm_eps must be positive, got {}", norm_eps));
}

nlohmann::json ModelConfig::to_json() const {
  return {{"vocab_size", vocab_size}, {"hidden", hidden},       {"layers", layers},
          {"heads", heads},           {"intermediate", intermediate_size()},
          {"context", context},       {"rope_theta", rope_theta}, {"norm_eps", norm_eps}};
}

ModelConfig ModelConfig::from_json(const nlohmann::json& j) {
  ModelConfig c;
  c.vocab_size = j.at("vocab_size").get<int64_t>();
  c.hidden = j.at("hidden").get<int64_t>();
  c.layers = j.at("layers").get<int64_t>();
  c.heads = j.at("heads").get<int64_t>();
  c.intermediate = j.at("intermediate").get<int64_t>();
  c.context = j.at("context").get<int64_t>();
  c.rope_theta = j.at("rope_theta").get<double>();
  c.norm_eps = j.at("norm_eps").get<double>();
  c.validate();
  return c;
}

nlohmann::json ModelConfig::to_hf_json() const {
  return {{"architectures", {"LlamaForCausalLM"}},
          {"model_type", "llama"},
          {"vocab_size", vocab_size},
          {"hidden_size", hidden},
          {"intermediate_size", intermediate_size()},
          {"num_hidden_layers", layers},
          {"num_attention_heads", heads},
          {"num_key_value_heads", heads},
          {"max_position_embeddings", context},
          {"rope_theta", rope_theta},
          {"rms_norm_eps", norm_eps},
          {"hidden_act", "silu"},
          {"tie_word_embeddings", false},
          {"attention_bias", false},
          {"mlp_bias", false},
          {"torch_dtype", "float32"}};
}

ModelConfig model_preset(const std::string& name) {
  ModelConfig c;
  if (name == "tiny") {
    c.hidden = 128, c.layers = 4, c.heads = 4, c.intermediate = 384, c.context = 64;
  } else if (name == "125m") {
    c.hidden = 768, c.layers = 12, c.heads = 12, c.intermediate = 3072, c.context = 1024;
  } else if (name == "1.3b") {
    c.hidden = 2048, c.layers = 24, c.heads = 32, c.intermediate = 8192, c.context = 1024;
  } else if (name == "6.8b") {
    c.hidden = 4096, c.layers = 32, c.heads = 32, c.intermediate = 16384, c.context = 1024;
  } else {
    throw std::invalid_argument(
        fmt::format("unknown model preset '{}' (tiny, 125m, 1.3b, 6.8b)", name));
  }
  return c;
}

}  // namespace noloco
