// The noloco command line: a thin layer over train/, model/ and comm/.
#include <iostream>
#include <map>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <torch/torch.h>

#include "data/tokenizer.h"
#include "model/generate.h"
#include "model/llama.h"
#include "train/bench.h"
#include "train/checkpoint.h"
#include "train/config.h"
#include "train/export.h"
#include "train/trainer.h"

using namespace noloco;

namespace {

std::string keys_help() {
  std::string s = "\nConfig keys (YAML or key=value):\n";
  for (auto& k : config_keys()) s += fmt::format("  {:<20} {}\n", k.name, k.help);
  return s;
}

// key=value arguments of the commands that are not configs.
std::map<std::string, std::string> parse_pairs(const std::vector<std::string>& args,
                                               const std::vector<std::string>& allowed) {
  std::map<std::string, std::string> out;
  for (auto& a : args) {
    const auto eq = a.find('=');
    const auto key = eq == std::string::npos ? a : a.substr(0, eq);
    if (eq == std::string::npos || std::find(allowed.begin(), allowed.end(), key) == allowed.end())
      throw std::invalid_argument(fmt::format("unexpected argument '{}' (allowed: {}=...)", a, fmt::join(allowed, "=..., ")));
    out[key] = a.substr(eq + 1);
  }
  return out;
}

int run_generate(const std::string& checkpoint, const std::vector<std::string>& args) {
  auto kv = parse_pairs(args, {"prompt", "temperature", "top_k", "seed", "tokens", "device"});
  // Reuse the config parser's strict number parsing for these keys.
  auto cfg = parse_config("", {});
  const auto path = find_checkpoint(checkpoint);
  if (path.empty()) throw std::runtime_error(fmt::format("no checkpoint found at '{}'", checkpoint));
  auto ckpt = read_checkpoint(path, /*with_state=*/false);
  auto tokenizer = load_tokenizer(path);
  SamplingOptions o;
  auto number = [&](const char* key, double fallback) {
    auto it = kv.find(key);
    if (it == kv.end()) return fallback;
    size_t used = 0;
    double v = 0;
    try {
      v = std::stod(it->second, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used == 0 || used != it->second.size()) throw std::invalid_argument(fmt::format("{}: '{}' is not a number", key, it->second));
    return v;
  };
  o.temperature = number("temperature", o.temperature);
  o.top_k = int64_t(number("top_k", double(o.top_k)));
  o.seed = uint64_t(number("seed", 0));
  o.tokens = int64_t(number("tokens", double(o.tokens)));
  if (o.temperature < 0 || o.top_k < 0 || o.tokens < 0)
    throw std::invalid_argument("temperature, top_k and tokens must be >= 0");
  torch::Device device(kv.count("device") ? kv["device"] : cfg.device);
  LlamaForCausalLM model(ckpt.model);
  {
    torch::NoGradGuard no_grad;
    for (auto& p : model->named_parameters()) p.value().copy_(ckpt.weights.at(p.key()));
  }
  model->to(device);
  const auto prompt = tokenizer->encode(kv.count("prompt") ? kv["prompt"] : "\n");
  const auto ids = generate(model, prompt, o);
  std::cout << tokenizer->decode(ids) << std::endl;
  return 0;
}

int run_bench(const std::vector<std::string>& args) {
  std::vector<std::string> overrides;
  int64_t steps = 10;
  double peak = 0;
  for (auto& a : args) {
    if (a.rfind("bench_steps=", 0) == 0) {
      steps = std::stoll(a.substr(12));
    } else if (a.rfind("peak_tflops=", 0) == 0) {
      peak = std::stod(a.substr(12));
    } else {
      overrides.push_back(a);
    }
  }
  const auto cfg = parse_config("", overrides);
  const auto r = bench_training(cfg, steps, peak);
  fmt::print("bench {} ({} params) on {}: batch {} x {} tokens, {} threads\n", r["model"].get<std::string>(),
             r["params"].get<int64_t>(), r["device"].get<std::string>(), r["batch"].get<int64_t>(),
             r["context"].get<int64_t>(), r["threads"].get<int>());
  fmt::print("  {:.0f} tokens/s (forward+backward+AdamW), {:.3f} TFLOP/s, MFU {:.1f}% of {:.2f} TFLOP/s ({})\n",
             r["tokens_per_s"].get<double>(), r["achieved_tflops"].get<double>(), 100 * r["mfu"].get<double>(),
             r["peak_tflops"].get<double>(), r["peak_source"].get<std::string>());
  std::cout << r.dump() << std::endl;
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"noloco: Llama training with NoLoCo, DiLoCo and DDP over c10d"};
  app.require_subcommand(1);

  std::string config_path;
  std::vector<std::string> overrides;
  auto* train_cmd = app.add_subcommand("train", "train a model (CONFIG then key=value overrides)");
  train_cmd->add_option("config", config_path, "YAML config, e.g. configs/shakespeare.yaml")->required();
  train_cmd->add_option("overrides", overrides, "key=value overrides");
  train_cmd->footer(keys_help());

  std::string checkpoint;
  std::vector<std::string> gen_args;
  auto* gen_cmd = app.add_subcommand("generate", "sample text from a checkpoint or run directory");
  gen_cmd->add_option("checkpoint", checkpoint, "checkpoint directory or run directory")->required();
  gen_cmd->add_option("options", gen_args, "prompt=... temperature=0.8 top_k=40 seed=0 tokens=200 device=cpu");

  std::string hf_dir;
  auto* export_cmd = app.add_subcommand("export", "write a checkpoint in the Hugging Face Llama layout");
  export_cmd->add_option("checkpoint", checkpoint, "checkpoint directory or run directory")->required();
  export_cmd->add_option("hf_dir", hf_dir, "output directory")->required();

  std::vector<std::string> bench_args;
  auto* bench_cmd = app.add_subcommand("bench", "training throughput and model-FLOPs utilisation");
  bench_cmd->add_option("options", bench_args, "config keys (model=125m batch=4 ...), bench_steps=N, peak_tflops=X");
  bench_cmd->footer(keys_help());

  CLI11_PARSE(app, argc, argv);
  try {
    if (*train_cmd) {
      const auto cfg = load_config(config_path, overrides);
      train(cfg, WorkerInfo{});
      return 0;
    }
    if (*gen_cmd) return run_generate(checkpoint, gen_args);
    if (*export_cmd) {
      export_hf(checkpoint, hf_dir);
      fmt::print("exported {} to {}\n", checkpoint, hf_dir);
      return 0;
    }
    if (*bench_cmd) return run_bench(bench_args);
  } catch (const c10::Error& e) {
    std::string msg = e.what_without_backtrace();
    std::cerr << "noloco: error: " << msg.substr(0, msg.find('\n')) << std::endl;
    return 1;
  } catch (const std::exception& e) {
    std::string msg = e.what();
    std::cerr << "noloco: error: " << msg.substr(0, msg.find('\n')) << std::endl;
    return 1;
  }
  return 0;
}
