#include "pipeline/worker_model.h"

#include "model/hf_directory.h"
#include "util/torch_shim.h"

namespace noloco {

namespace {

class WholeModel final : public WorkerModel {
 public:
  WholeModel(const ModelConfig& model, const StepOptions& options, StepData data, torch::Device device)
      : o_(options), data_(data), device_(device), model_(model) {
    initialise_weights(model_, o_);
    model_->to(device);
  }

  torch::nn::Module& module() override { return *model_; }
  LlamaForCausalLM* whole_model() override { return &model_; }

  StepOutcome train_step(int64_t step) override {
    double loss_sum = 0;
    for (int64_t micro = 0; micro < o_.grad_accum; ++micro) {
      auto b = data_.train.sample(uint64_t(step * o_.grad_accum + micro), data_.replica * o_.batch, o_.batch);
      torch::Tensor loss;
      {
        shim::CudaBf16Autocast autocast(o_.bf16);
        loss = model_->loss(b.inputs.to(device_), b.targets.to(device_)) / double(o_.grad_accum);
      }
      loss.backward();
      loss_sum += loss.item<double>();
    }
    return {loss_sum, o_.grad_accum};
  }

  double evaluate(int64_t) override {
    torch::NoGradGuard no_grad;
    double sum = 0;
    for (int64_t i = 0; i < o_.eval_batches; ++i) {
      auto b = data_.val.sample(uint64_t(i), 0, o_.eval_batch);
      shim::CudaBf16Autocast autocast(o_.bf16);
      sum += model_->loss(b.inputs.to(device_), b.targets.to(device_)).item<double>();
    }
    return sum / double(o_.eval_batches);
  }

 private:
  StepOptions o_;
  StepData data_;
  torch::Device device_;
  LlamaForCausalLM model_;
};

}  // namespace

void initialise_weights(LlamaForCausalLM& model, const StepOptions& options) {
  if (options.init_from.empty()) {
    init_weights(model, options.seed);
  } else {
    load_hf_weights(model, options.init_from);
  }
}

std::unique_ptr<WorkerModel> make_whole_model(const ModelConfig& model, const StepOptions& options, StepData data,
                                              torch::Device device) {
  return std::make_unique<WholeModel>(model, options, data, device);
}

}  // namespace noloco
