#include "train/forward_backward.h"

#include "util/torch_shim.h"

namespace noloco {

namespace {

class WholeModel final : public ForwardBackward {
 public:
  WholeModel(const TrainConfig& c, const ModelConfig& arch, StepData data, torch::Device device)
      : c_(c), data_(data), device_(device), model_(arch) {
    init_weights(model_, c.seed);
    model_->to(device);
  }

  torch::nn::Module& module() override { return *model_; }
  LlamaForCausalLM* whole_model() override { return &model_; }

  double train_step(int64_t step) override {
    double loss_sum = 0;
    for (int64_t micro = 0; micro < c_.grad_accum; ++micro) {
      auto b = data_.train.sample(uint64_t(step * c_.grad_accum + micro), data_.replica * c_.batch, c_.batch);
      torch::Tensor loss;
      {
        shim::CudaBf16Autocast autocast(c_.precision == "bf16");
        loss = model_->loss(b.inputs.to(device_), b.targets.to(device_)) / double(c_.grad_accum);
      }
      loss.backward();
      loss_sum += loss.item<double>();
    }
    return loss_sum;
  }

  double evaluate() override {
    torch::NoGradGuard no_grad;
    double sum = 0;
    for (int64_t i = 0; i < c_.eval_batches; ++i) {
      auto b = data_.val.sample(uint64_t(i), 0, c_.batch);
      shim::CudaBf16Autocast autocast(c_.precision == "bf16");
      sum += model_->loss(b.inputs.to(device_), b.targets.to(device_)).item<double>();
    }
    return sum / double(c_.eval_batches);
  }

 private:
  const TrainConfig& c_;
  StepData data_;
  torch::Device device_;
  LlamaForCausalLM model_;
};

}  // namespace

std::unique_ptr<ForwardBackward> make_whole_model(const TrainConfig& c, const ModelConfig& arch, StepData data,
                                                  torch::Device device) {
  return std::make_unique<WholeModel>(c, arch, data, device);
}

}  // namespace noloco
