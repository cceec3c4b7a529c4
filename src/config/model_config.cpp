#include "config/model_config.h"

#include <cmath>
#include <optional>
#include <stdexcept>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "util/files.h"

namespace noloco {

int64_t ModelConfig::intermediate_size() const {
  if (intermediate > 0) return intermediate;
  const int64_t raw = (8 * hidden) / 3;
  return (raw + 63) / 64 * 64;
}

std::vector<double> ModelConfig::rope_inverse_frequencies() const {
  std::vector<double> inv;
  const int64_t d = head_dim();
  for (int64_t i = 0; i < d; i += 2) inv.push_back(std::pow(rope_theta, -double(i) / double(d)));
  const auto& s = rope_scaling;
  if (s.type == "linear")
    for (auto& f : inv) f /= s.factor;
  if (s.type == "llama3") {
    // Llama 3.1's rule: wavelengths shorter than original_context /
    // high_freq_factor stay, longer than original_context / low_freq_factor
    // are stretched by `factor`, and the band between is interpolated.
    const double pi = std::acos(-1.0);
    const double low_wavelen = double(s.original_context) / s.low_freq_factor;
    const double high_wavelen = double(s.original_context) / s.high_freq_factor;
    for (auto& f : inv) {
      const double wavelen = 2 * pi / f;
      if (wavelen < high_wavelen) continue;
      if (wavelen > low_wavelen) {
        f /= s.factor;
        continue;
      }
      const double smooth =
          (double(s.original_context) / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
      f = (1 - smooth) * f / s.factor + smooth * f;
    }
  }
  return inv;
}

std::vector<std::pair<std::string, std::vector<int64_t>>> ModelConfig::parameter_shapes() const {
  const int64_t h = hidden, f = intermediate_size(), q = heads * head_dim(), kv = key_value_heads() * head_dim();
  std::vector<std::pair<std::string, std::vector<int64_t>>> shapes = {{"model.embed_tokens.weight", {vocab_size, h}}};
  for (int64_t i = 0; i < layers; ++i) {
    const auto l = fmt::format("model.layers.{}.", i);
    shapes.push_back({l + "self_attn.q_proj.weight", {q, h}});
    shapes.push_back({l + "self_attn.k_proj.weight", {kv, h}});
    shapes.push_back({l + "self_attn.v_proj.weight", {kv, h}});
    shapes.push_back({l + "self_attn.o_proj.weight", {h, q}});
    shapes.push_back({l + "mlp.gate_proj.weight", {f, h}});
    shapes.push_back({l + "mlp.up_proj.weight", {f, h}});
    shapes.push_back({l + "mlp.down_proj.weight", {h, f}});
    shapes.push_back({l + "input_layernorm.weight", {h}});
    shapes.push_back({l + "post_attention_layernorm.weight", {h}});
  }
  shapes.push_back({"model.norm.weight", {h}});
  if (!tied_embeddings) shapes.push_back({"lm_head.weight", {vocab_size, h}});
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
  // The embedding lookup is no matmul; the output layer is one, tied or not.
  const double matmul_params = double(num_params() - (tied_embeddings ? 0 : vocab_size * hidden));
  return 6.0 * matmul_params + 6.0 * double(layers) * double(context) * double(heads * head_dim());
}

void ModelConfig::validate() const {
  auto fail = [](const std::string& m) { throw std::invalid_argument(m); };
  if (vocab_size <= 0) fail(fmt::format("vocab_size must be positive, got {}", vocab_size));
  if (hidden <= 0) fail(fmt::format("hidden must be positive, got {}", hidden));
  if (layers <= 0) fail(fmt::format("layers must be positive, got {}", layers));
  if (heads <= 0) fail(fmt::format("heads must be positive, got {}", heads));
  if (head_size < 0) fail(fmt::format("head_dim must be >= 0, got {}", head_size));
  if (head_size == 0 && hidden % heads != 0)
    fail(fmt::format("heads ({}) must divide hidden ({}) unless head_dim is given", heads, hidden));
  if (kv_heads < 0) fail(fmt::format("kv_heads must be >= 0, got {}", kv_heads));
  if (heads % key_value_heads() != 0)
    fail(fmt::format("kv_heads ({}) must divide heads ({})", key_value_heads(), heads));
  if (head_dim() % 2 != 0)
    fail(fmt::format("head_dim ({}) must be even for rotary embeddings", head_dim()));
  if (intermediate < 0) fail(fmt::format("intermediate must be >= 0, got {}", intermediate));
  if (context <= 0) fail(fmt::format("context must be positive, got {}", context));
  if (!(rope_theta > 0)) fail(fmt::format("rope_theta must be positive, got {}", rope_theta));
  if (!(norm_eps > 0)) fail(fmt::format("norm_eps must be positive, got {}", norm_eps));
  const auto& r = rope_scaling;
  if (r.type != "none" && r.type != "linear" && r.type != "llama3")
    fail(fmt::format("rope_scaling type '{}' is not implemented (none, linear, llama3)", r.type));
  if (!(r.factor > 0)) fail(fmt::format("rope_scaling factor must be positive, got {}", r.factor));
  if (r.type == "llama3" && !(r.high_freq_factor > r.low_freq_factor && r.low_freq_factor > 0 && r.original_context > 0))
    fail("rope_scaling llama3 needs high_freq_factor > low_freq_factor > 0 and original_max_position_embeddings > 0");
}

namespace {

nlohmann::json rope_scaling_json(const RopeScaling& r) {
  if (r.type == "none") return nullptr;
  if (r.type == "linear") return {{"rope_type", "linear"}, {"factor", r.factor}};
  return {{"rope_type", r.type},
          {"factor", r.factor},
          {"low_freq_factor", r.low_freq_factor},
          {"high_freq_factor", r.high_freq_factor},
          {"original_max_position_embeddings", r.original_context}};
}

// config.json's rope_scaling (rope_type, or type in older files); throws naming what is not implemented.
RopeScaling rope_scaling_of(const nlohmann::json& j) {
  RopeScaling r;
  if (j.is_null()) return r;
  if (!j.is_object()) throw std::invalid_argument(fmt::format("'rope_scaling' must be an object, got {}", j.dump()));
  const auto type = j.value("rope_type", j.value("type", std::string("?")));
  if (type == "default") return r;
  if (type != "linear" && type != "llama3")
    throw std::invalid_argument(
        fmt::format("rope_scaling type '{}' is not implemented (default, linear and llama3 are)", type));
  auto number = [&](const char* key) {
    const auto it = j.find(key);
    if (it == j.end() || !it->is_number())
      throw std::invalid_argument(fmt::format("rope_scaling {} needs a number '{}'", type, key));
    return it->get<double>();
  };
  r.type = type;
  r.factor = number("factor");
  if (type == "llama3") {
    r.low_freq_factor = number("low_freq_factor");
    r.high_freq_factor = number("high_freq_factor");
    r.original_context = int64_t(number("original_max_position_embeddings"));
  }
  return r;
}

}  // namespace

nlohmann::json ModelConfig::to_json() const {
  return {{"vocab_size", vocab_size}, {"hidden", hidden},       {"layers", layers},
          {"heads", heads},           {"kv_heads", key_value_heads()}, {"intermediate", intermediate_size()},
          {"context", context},       {"rope_theta", rope_theta}, {"norm_eps", norm_eps},
          {"rope_scaling", rope_scaling_json(rope_scaling)},
          {"head_dim", head_size},
          {"tied_embeddings", tied_embeddings}};
}

ModelConfig ModelConfig::from_json(const nlohmann::json& j) {
  ModelConfig c;
  c.vocab_size = j.at("vocab_size").get<int64_t>();
  c.hidden = j.at("hidden").get<int64_t>();
  c.layers = j.at("layers").get<int64_t>();
  c.heads = j.at("heads").get<int64_t>();
  c.kv_heads = j.value("kv_heads", int64_t(0));  // absent in checkpoints from before grouped-query attention
  c.intermediate = j.at("intermediate").get<int64_t>();
  c.context = j.at("context").get<int64_t>();
  c.rope_theta = j.at("rope_theta").get<double>();
  c.norm_eps = j.at("norm_eps").get<double>();
  c.rope_scaling = rope_scaling_of(j.value("rope_scaling", nlohmann::json()));  // absent before rope scaling
  c.head_size = j.value("head_dim", int64_t(0));                  // absent before head_dim and tying
  c.tied_embeddings = j.value("tied_embeddings", false);
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
          {"num_key_value_heads", key_value_heads()},
          {"max_position_embeddings", context},
          {"rope_theta", rope_theta},
          {"rms_norm_eps", norm_eps},
          {"rope_scaling", rope_scaling_json(rope_scaling)},
          {"head_dim", head_dim()},
          {"hidden_act", "silu"},
          {"tie_word_embeddings", tied_embeddings},
          {"attention_bias", false},
          {"mlp_bias", false},
          {"torch_dtype", "float32"}};
}

ModelConfig ModelConfig::from_hf_json(const nlohmann::json& j) {
  auto fail = [](const std::string& m) { throw std::invalid_argument(m); };
  if (!j.is_object()) fail("config.json is not a JSON object");
  if (const auto a = j.find("architectures"); a != j.end()) {
    if (!a->is_array() || a->size() != 1 || !(*a)[0].is_string() || (*a)[0] != "LlamaForCausalLM")
      fail(fmt::format("architectures is {}: only LlamaForCausalLM is supported", a->dump()));
  }
  if (const auto t = j.find("model_type"); t != j.end() && *t != "llama")
    fail(fmt::format("model_type is {}: only llama is supported", t->dump()));
  auto integer = [&](const char* key, std::optional<int64_t> fallback) -> int64_t {
    const auto it = j.find(key);
    if (it == j.end() || it->is_null()) {
      if (!fallback) fail(fmt::format("config.json has no '{}'", key));
      return *fallback;
    }
    if (!it->is_number_integer()) fail(fmt::format("'{}' must be an integer, got {}", key, it->dump()));
    return it->get<int64_t>();
  };
  auto number = [&](const char* key, double fallback) {
    const auto it = j.find(key);
    if (it == j.end() || it->is_null()) return fallback;
    if (!it->is_number()) fail(fmt::format("'{}' must be a number, got {}", key, it->dump()));
    return it->get<double>();
  };
  auto must_be = [&](const char* key, const nlohmann::json& allowed, const char* why) {
    const auto it = j.find(key);
    if (it != j.end() && !it->is_null() && *it != allowed)
      fail(fmt::format("'{}' is {}: {}", key, it->dump(), why));
  };
  must_be("attention_bias", false, "attention biases are not implemented");
  must_be("mlp_bias", false, "MLP biases are not implemented");
  must_be("hidden_act", "silu", "only silu is implemented");
  ModelConfig c;
  c.vocab_size = integer("vocab_size", std::nullopt);
  c.hidden = integer("hidden_size", std::nullopt);
  c.layers = integer("num_hidden_layers", std::nullopt);
  c.heads = integer("num_attention_heads", std::nullopt);
  c.kv_heads = integer("num_key_value_heads", c.heads);
  c.intermediate = integer("intermediate_size", std::nullopt);
  c.context = integer("max_position_embeddings", 2048);
  c.rope_theta = number("rope_theta", 10000.0);
  c.norm_eps = number("rms_norm_eps", 1e-6);
  // HF's rope_scaling is null for plain rotary embeddings; "default" is the same thing.
  c.rope_scaling = rope_scaling_of(j.value("rope_scaling", nlohmann::json()));
  // transformers 5 writes both in one object, rope_parameters, instead.
  if (const auto p = j.find("rope_parameters"); p != j.end() && !p->is_null()) {
    if (!p->is_object()) fail(fmt::format("'rope_parameters' must be an object, got {}", p->dump()));
    if (const auto theta = p->find("rope_theta"); theta != p->end()) {
      if (!theta->is_number()) fail(fmt::format("'rope_parameters.rope_theta' must be a number, got {}", theta->dump()));
      c.rope_theta = theta->get<double>();
    }
    c.rope_scaling = rope_scaling_of(*p);
  }
  // Kept only where it differs from hidden/heads, so that a directory and
  // our own model of the same shape have the same config.
  const int64_t head_dim = integer("head_dim", 0);
  if (head_dim != 0 && (c.heads <= 0 || head_dim * c.heads != c.hidden)) c.head_size = head_dim;
  if (const auto tie = j.find("tie_word_embeddings"); tie != j.end() && !tie->is_null()) {
    if (!tie->is_boolean()) fail(fmt::format("'tie_word_embeddings' must be true or false, got {}", tie->dump()));
    c.tied_embeddings = tie->get<bool>();
  }
  if (c.intermediate <= 0) fail(fmt::format("intermediate_size must be positive, got {}", c.intermediate));
  c.validate();
  return c;
}

ModelConfig read_hf_config(const std::string& dir) {
  try {
    return ModelConfig::from_hf_json(read_json(dir + "/config.json"));
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument(fmt::format("{}/config.json: {}", dir, e.what()));
  }
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
