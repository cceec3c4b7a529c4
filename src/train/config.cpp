#include "train/config.h"

#include <cmath>
#include <functional>
#include <sstream>
#include <stdexcept>

#include <fmt/format.h>
#include <yaml-cpp/yaml.h>

#include "pipeline/routing.h"
#include "util/files.h"
#include "util/parse_number.h"

namespace noloco {

namespace {

[[noreturn]] void invalid(const std::string& m) { throw std::invalid_argument(m); }

template <class T>
T parse_value(const std::string& key, const std::string& s);

template <>
int64_t parse_value<int64_t>(const std::string& key, const std::string& s) {
  return parse_integer(key, s);
}
template <>
uint64_t parse_value<uint64_t>(const std::string& key, const std::string& s) {
  const int64_t v = parse_value<int64_t>(key, s);
  if (v < 0) invalid(fmt::format("{}: must be non-negative, got {}", key, s));
  return uint64_t(v);
}
template <>
double parse_value<double>(const std::string& key, const std::string& s) {
  return parse_real(key, s);
}
template <>
bool parse_value<bool>(const std::string& key, const std::string& s) {
  if (s == "true" || s == "1" || s == "yes" || s == "on") return true;
  if (s == "false" || s == "0" || s == "no" || s == "off") return false;
  invalid(fmt::format("{}: '{}' is not a boolean", key, s));
}
template <>
std::string parse_value<std::string>(const std::string&, const std::string& s) {
  return s;
}

std::string show(const std::string& s) { return s; }
std::string show(bool b) { return b ? "true" : "false"; }
std::string show(double d) { return fmt::format("{}", d); }
std::string show(int64_t i) { return std::to_string(i); }
std::string show(uint64_t i) { return std::to_string(i); }

struct Field {
  std::string name, help;
  std::function<void(TrainConfig&, const std::string&)> set;
  std::function<std::string(const TrainConfig&)> get;
};

template <class Access>
Field field(std::string name, std::string help, Access access) {
  using T = std::remove_reference_t<decltype(access(std::declval<TrainConfig&>()))>;
  Field f;
  f.name = name;
  f.help = std::move(help);
  f.set = [access, name](TrainConfig& c, const std::string& v) { access(c) = parse_value<T>(name, v); };
  f.get = [access](const TrainConfig& c) { return show(access(const_cast<TrainConfig&>(c))); };
  return f;
}

#define NOLOCO_KEY(member, help) field(#member, help, [](TrainConfig& c) -> auto& { return c.member; })
#define NOLOCO_ARCH_KEY(member, help) \
  field(#member, help, [](TrainConfig& c) -> auto& { return c.arch.member; })

const std::vector<Field>& fields() {
  static const std::vector<Field> all = {
      NOLOCO_KEY(data, "training text (.txt) or token file (.bin)"),
      NOLOCO_KEY(val_data, "validation token file; default: last val_fraction of data"),
      NOLOCO_KEY(tokenizer, "char | bpe | path to a sentencepiece .model"),
      NOLOCO_KEY(vocab_size, "BPE vocabulary to train, or vocabulary of a token file"),
      NOLOCO_KEY(val_fraction, "fraction of the corpus held out for validation"),
      NOLOCO_KEY(model, "preset: tiny | 125m | 1.3b | 6.8b (keys below override it)"),
      NOLOCO_ARCH_KEY(hidden, "hidden size"),
      NOLOCO_ARCH_KEY(layers, "decoder layers"),
      NOLOCO_ARCH_KEY(heads, "attention heads"),
      NOLOCO_ARCH_KEY(intermediate, "MLP size; 0: 8/3·hidden rounded to 64"),
      NOLOCO_ARCH_KEY(context, "sequence length"),
      NOLOCO_ARCH_KEY(rope_theta, "rotary base"),
      NOLOCO_ARCH_KEY(norm_eps, "RMSNorm epsilon"),
      NOLOCO_KEY(batch, "sequences per micro-batch per replica"),
      NOLOCO_KEY(grad_accum, "micro-batches per step (the pipeline's M)"),
      NOLOCO_KEY(steps, "inner steps"),
      NOLOCO_KEY(warmup, "linear warmup steps"),
      NOLOCO_KEY(decay_steps, "cosine decay length; 0: steps"),
      NOLOCO_KEY(lr, "peak learning rate"),
      NOLOCO_KEY(min_lr, "learning rate at the end of the decay"),
      NOLOCO_KEY(beta1, "AdamW beta1"),
      NOLOCO_KEY(beta2, "AdamW beta2"),
      NOLOCO_KEY(weight_decay, "AdamW weight decay (2-D weights only)"),
      NOLOCO_KEY(clip, "global gradient-norm clip; 0 disables"),
      NOLOCO_KEY(eval_interval, "steps between evaluations"),
      NOLOCO_KEY(eval_batches, "validation batches per evaluation"),
      NOLOCO_KEY(log_interval, "steps between progress lines"),
      NOLOCO_KEY(sample_tokens, "tokens generated at each evaluation; 0: none"),
      NOLOCO_KEY(sample_prompt, "prompt of the evaluation samples"),
      NOLOCO_KEY(seed, "run seed"),
      NOLOCO_KEY(device, "cpu | cuda | cuda:N"),
      NOLOCO_KEY(precision, "fp32 | bf16 (CUDA autocast; weights and optimizer stay fp32)"),
      NOLOCO_KEY(threads, "intra-op threads per worker; 0: cores / local replicas"),
      NOLOCO_KEY(out, "run directory; default runs/<method>-<date>"),
      NOLOCO_KEY(checkpoint_interval, "steps between checkpoints; 0: at every evaluation"),
      NOLOCO_KEY(resume, "continue from the latest checkpoint in out"),
      NOLOCO_KEY(method, "none | ddp | diloco | noloco"),
      NOLOCO_KEY(replicas, "data-parallel replicas"),
      NOLOCO_KEY(stages, "pipeline stages per replica (replicas x stages workers)"),
      NOLOCO_KEY(stage_layers, "layers per stage, e.g. 3,5; empty: balanced"),
      NOLOCO_KEY(routing, "random | fixed: routing of micro-batches between stage replicas"),
      NOLOCO_KEY(outer_interval, "H, inner steps per outer step; 0: 100 diloco, 50 noloco"),
      NOLOCO_KEY(outer_momentum, "alpha; <0: 0.3 diloco, 0.5 noloco"),
      NOLOCO_KEY(outer_lr, "beta, outer learning rate"),
      NOLOCO_KEY(gamma, "NoLoCo pull toward the group mean; <0: equal to outer_lr"),
      NOLOCO_KEY(group_size, "NoLoCo group size n"),
      NOLOCO_KEY(wire_dtype, "dtype of exchanged weights: fp32 | bf16"),
      NOLOCO_KEY(bind, "address workers and the store listen on"),
      NOLOCO_KEY(port, "store port; 0: a free one"),
      NOLOCO_KEY(peer_timeout, "seconds before a silent peer is given up"),
      NOLOCO_KEY(restarts, "noloco: restart a failed worker up to this many times; it rejoins from a live peer"),
      NOLOCO_KEY(heartbeat_timeout, "seconds without a heartbeat before the launcher kills a hung worker and partners stop waiting"),
      NOLOCO_KEY(inject_crash, "failure drill: RANK:STEP[:checkpoint|:freeze][,...] kills that worker (SIGKILL) before that step, or while writing its checkpoint, or freezes it (SIGSTOP)"),
  };
  return all;
}

const Field* find_field(const std::string& name) {
  for (auto& f : fields())
    if (f.name == name) return &f;
  return nullptr;
}

}  // namespace

std::vector<ConfigKey> config_keys() {
  std::vector<ConfigKey> keys;
  for (auto& f : fields()) keys.push_back({f.name, f.help});
  return keys;
}

void TrainConfig::resolve() {
  if (decay_steps == 0) decay_steps = steps;
  if (outer_interval == 0) outer_interval = method == "diloco" ? 100 : 50;
  if (outer_momentum < 0) outer_momentum = method == "diloco" ? 0.3 : 0.5;
  if (gamma < 0) gamma = outer_lr;
}

void TrainConfig::validate() const {
  auto positive = [](const char* key, double v) {
    if (!(v > 0)) invalid(fmt::format("{} must be positive, got {}", key, v));
  };
  auto non_negative = [](const char* key, double v) {
    if (v < 0) invalid(fmt::format("{} must be >= 0, got {}", key, v));
  };
  if (data.empty()) invalid("data must name a file");
  if (!(val_fraction > 0 && val_fraction < 1)) invalid(fmt::format("val_fraction must be in (0, 1), got {}", val_fraction));
  non_negative("vocab_size", double(vocab_size));
  if (tokenizer == "bpe" && vocab_size < 260) invalid("tokenizer=bpe needs vocab_size >= 260");
  ModelConfig shape = arch;
  shape.vocab_size = 1;  // known only once the tokenizer is built
  shape.validate();
  positive("batch", double(batch));
  positive("grad_accum", double(grad_accum));
  positive("steps", double(steps));
  non_negative("warmup", double(warmup));
  non_negative("decay_steps", double(decay_steps));
  positive("lr", lr);
  non_negative("min_lr", min_lr);
  if (min_lr > lr) invalid(fmt::format("min_lr ({}) must not exceed lr ({})", min_lr, lr));
  if (!(beta1 >= 0 && beta1 < 1)) invalid(fmt::format("beta1 must be in [0, 1), got {}", beta1));
  if (!(beta2 >= 0 && beta2 < 1)) invalid(fmt::format("beta2 must be in [0, 1), got {}", beta2));
  non_negative("weight_decay", weight_decay);
  non_negative("clip", clip);
  positive("eval_interval", double(eval_interval));
  positive("eval_batches", double(eval_batches));
  positive("log_interval", double(log_interval));
  non_negative("sample_tokens", double(sample_tokens));
  non_negative("threads", double(threads));
  non_negative("checkpoint_interval", double(checkpoint_interval));
  if (device != "cpu" && device != "cuda" && device.rfind("cuda:", 0) != 0)
    invalid(fmt::format("device must be cpu, cuda or cuda:N, got '{}'", device));
  if (precision != "fp32" && precision != "bf16")
    invalid(fmt::format("precision must be fp32 or bf16, got '{}'", precision));
  if (precision == "bf16" && device.rfind("cuda", 0) != 0) invalid("precision=bf16 needs device=cuda");
  if (method != "none" && method != "ddp" && method != "diloco" && method != "noloco")
    invalid(fmt::format("method must be none, ddp, diloco or noloco, got '{}'", method));
  positive("replicas", double(replicas));
  if (method == "none" && replicas > 1) invalid("replicas > 1 needs a method (ddp, diloco or noloco)");
  positive("stages", double(stages));
  stage_layer_ranges(arch.layers, stages, stage_layers);
  if (routing != "random" && routing != "fixed")
    invalid(fmt::format("routing must be random or fixed, got '{}'", routing));
  non_negative("outer_interval", double(outer_interval));
  positive("outer_lr", outer_lr);
  if (group_size < 2) invalid(fmt::format("group_size must be >= 2, got {}", group_size));
  if (wire_dtype != "fp32" && wire_dtype != "bf16")
    invalid(fmt::format("wire_dtype must be fp32 or bf16, got '{}'", wire_dtype));
  if (wire_dtype == "bf16" && method != "noloco")
    invalid("wire_dtype=bf16 applies to noloco's point-to-point exchange; all-reduce methods send fp32");
  if (port < 0 || port > 65535) invalid(fmt::format("port must be in [0, 65535], got {}", port));
  positive("peer_timeout", peer_timeout);
  non_negative("restarts", double(restarts));
  positive("heartbeat_timeout", heartbeat_timeout);
  if (restarts > 0 && (method != "noloco" || stages > 1))
    invalid("restarts needs method=noloco without pipeline stages (only NoLoCo can take a replica back mid-run)");
  for (const auto& point : crash_plan()) {
    if (point.rank < 0 || point.step < 0)
      invalid(fmt::format("inject_crash: RANK and STEP must be >= 0 in '{}'", inject_crash));
  }
}

std::vector<TrainConfig::CrashPoint> TrainConfig::crash_plan() const {
  std::vector<CrashPoint> plan;
  std::stringstream list(inject_crash);
  for (std::string item; std::getline(list, item, ',');) {
    std::vector<std::string> parts;
    std::stringstream fields(item);
    for (std::string part; std::getline(fields, part, ':');) parts.push_back(part);
    auto mode = CrashPoint::Mode::kill;
    if (parts.size() == 3 && parts[2] == "checkpoint") mode = CrashPoint::Mode::kill_in_checkpoint;
    if (parts.size() == 3 && parts[2] == "freeze") mode = CrashPoint::Mode::freeze;
    if (parts.size() != 2 && (parts.size() != 3 || mode == CrashPoint::Mode::kill))
      invalid(fmt::format("inject_crash must be RANK:STEP[:checkpoint|:freeze][,...], got '{}'", inject_crash));
    plan.push_back({parse_value<int64_t>("inject_crash", parts[0]), parse_value<int64_t>("inject_crash", parts[1]),
                    mode});
  }
  return plan;
}

std::string TrainConfig::to_yaml() const {
  std::string y;
  for (auto& f : fields()) {
    YAML::Emitter e;
    e << f.get(*this);
    y += fmt::format("{}: {}\n", f.name, e.c_str());
  }
  return y;
}

TrainConfig parse_config(const std::string& yaml_text, const std::vector<std::string>& overrides,
                         const std::string& origin) {
  // Collect key/value pairs first: the preset must apply before any key that overrides it,
  // wherever the two appear.
  std::vector<std::pair<std::string, std::string>> pairs;
  YAML::Node root;
  try {
    root = YAML::Load(yaml_text);
  } catch (const YAML::Exception& e) {
    invalid(fmt::format("{}: not valid YAML: {}", origin, e.msg));
  }
  if (root && !root.IsNull()) {
    if (!root.IsMap()) invalid(fmt::format("{}: expected a mapping of key: value", origin));
    for (const auto& kv : root) {
      if (!kv.first.IsScalar()) invalid(fmt::format("{}: keys must be plain names", origin));
      const auto key = kv.first.as<std::string>();
      if (!kv.second.IsScalar())
        invalid(fmt::format("{}: value of '{}' must be a single value", origin, key));
      pairs.emplace_back(key, kv.second.as<std::string>());
    }
  }
  for (const auto& o : overrides) {
    const auto eq = o.find('=');
    if (eq == std::string::npos || eq == 0) invalid(fmt::format("override '{}' is not key=value", o));
    pairs.emplace_back(o.substr(0, eq), o.substr(eq + 1));
  }
  TrainConfig c;
  for (const auto& [k, v] : pairs) {
    if (!find_field(k)) invalid(fmt::format("unknown config key '{}' (see `noloco train --help`)", k));
    if (k == "model") {
      c.model = v;
      c.arch = model_preset(v);
    }
  }
  for (const auto& [k, v] : pairs)
    if (k != "model") find_field(k)->set(c, v);
  c.resolve();
  c.validate();
  return c;
}

TrainConfig load_config(const std::string& yaml_path, const std::vector<std::string>& overrides) {
  std::string text;
  if (!yaml_path.empty()) text = read_file(yaml_path);
  return parse_config(text, overrides, yaml_path.empty() ? "config" : yaml_path);
}

}  // namespace noloco
