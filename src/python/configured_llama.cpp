#include "python/configured_llama.h"

#include <cmath>
#include <filesystem>
#include <stdexcept>

#include <fmt/format.h>

#include "optim/inner.h"

namespace noloco {

namespace {

TrainConfig replica_config(const std::string& path, const std::vector<std::string>& overrides, int replica) {
  auto config = load_config(path, overrides);
  config.validate();
  if (config.pipeline.stages != 1 || config.run.replica_workers != 1)
    throw std::invalid_argument(
        "noloco.Llama is a whole replica of one worker: stages and replica_workers must be 1");
  if (replica < 0 || replica >= config.run.replicas)
    throw std::invalid_argument(
        fmt::format("replica {} is not one of the config's {} replicas (give replicas=N)", replica,
                    config.run.replicas));
  if (config.run.out.empty()) throw std::invalid_argument("noloco.Llama needs out=DIR (its tokenizer and tokens go there)");
  std::filesystem::create_directories(config.run.out);
  return config;
}

}  // namespace

ConfiguredLlama::ConfiguredLlama(const std::string& config_path, const std::vector<std::string>& overrides,
                                 int replica)
    : config_(replica_config(config_path, overrides, replica)),
      corpus_(load_corpus(config_.data, config_.model.context, config_.run.out, config_.run.resume)),
      arch_(with_vocabulary(config_.model, *corpus_.tokenizer)),
      train_windows_(corpus_.train, arch_.context, config_.run.seed),
      val_windows_(corpus_.val, arch_.context, kValidationSeed) {
  const auto& c = config_;
  const StepOptions options{c.inner.batch,   c.inner.grad_accum, c.eval.batches, c.inner.batch,
                            false,           c.run.seed,         c.init_from};
  model_ = make_whole_model(arch_, options, {train_windows_, val_windows_, replica}, torch::Device(c.run.device));
}

std::vector<std::pair<std::string, torch::Tensor>> ConfiguredLlama::named_parameters() {
  std::vector<std::pair<std::string, torch::Tensor>> named;
  for (auto& p : model_->module().named_parameters(/*recurse=*/true)) named.emplace_back(p.key(), p.value());
  return named;
}

double ConfiguredLlama::train_step(int64_t step) { return model_->train_step(step).loss; }

double ConfiguredLlama::evaluate(int64_t step) {
  return corpus_.validates ? model_->evaluate(step) : std::nan("");
}

double ConfiguredLlama::learning_rate(int64_t step) const { return noloco::learning_rate(config_.inner, step); }

}  // namespace noloco
