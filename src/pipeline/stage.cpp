#include "pipeline/stage.h"

#include <string>
#include <vector>

#include "util/torch_shim.h"

namespace noloco {

StageModuleImpl::StageModuleImpl(LlamaForCausalLM& whole, LayerRange range, bool first, bool last)
    : config(whole->config) {
  // Plain containers named like the whole model's, so that parameter names,
  // checkpoints and exports stay in the Hugging Face layout.
  auto body = std::make_shared<torch::nn::Module>();
  auto layer_holder = std::make_shared<torch::nn::Module>();
  if (first) embed_tokens = body->register_module("embed_tokens", whole->model->embed_tokens);
  for (int64_t i = range.first; i < range.end; ++i) {
    auto layer = whole->model->layers->ptr<DecoderLayerImpl>(size_t(i));
    layers.emplace_back(layer_holder->register_module(std::to_string(i), layer));
  }
  body->register_module("layers", layer_holder);
  if (last) norm = body->register_module("norm", whole->model->norm);
  register_module("model", body);
  if (last) lm_head = register_module("lm_head", whole->lm_head);
}

torch::Tensor StageModuleImpl::forward(const torch::Tensor& input) {
  auto x = embed_tokens ? embed_tokens(input) : input;
  const auto& tables = cached_rotary_tables(rope_, config, x);
  for (auto& layer : layers) x = layer->forward(x, tables);
  return lm_head ? lm_head(norm(x)) : x;
}

namespace {

class PipelineStage final : public WorkerModel {
 public:
  PipelineStage(const ModelConfig& arch, const PipelineConfig& pipeline, const StepOptions& options, StepData data,
                torch::Device device, PipelinePlace place, ActivationLink& link)
      : o_(options), data_(data), device_(device), place_(place), link_(link), random_(pipeline.routing == "random"),
        one_f_one_b_(pipeline.schedule == "1f1b") {
    LlamaForCausalLM whole(arch);
    initialise_weights(whole, o_);
    const auto ranges = stage_layer_ranges(arch.layers, place.stages, pipeline.stage_layers);
    stage_ = StageModule(whole, ranges.at(size_t(place.stage)), place.first(), place.last());
    stage_->to(device);
  }

  torch::nn::Module& module() override { return *stage_; }
  bool computes_loss() const override { return place_.last(); }

  double train_step(int64_t step) override {
    struct InFlight {
      torch::Tensor input, output, labels;
      int origin = 0, from = 0, to = 0;  // data replica; replicas of the previous and next stage
    };
    const int64_t M = o_.grad_accum;
    const int s = place_.stage, d = place_.replica;
    std::vector<InFlight> flights(static_cast<size_t>(M));
    double loss_sum = 0;
    auto forward = [&](int64_t m) {
      auto& f = flights[size_t(m)];
      if (!place_.last()) f.to = route_permutation(o_.seed, step, m, s, place_.replicas, random_)[size_t(d)];
      if (place_.first()) {
        auto b = data_.train.sample(uint64_t(step * M + m), d * o_.batch, o_.batch);
        f.input = b.inputs.to(device_);
        f.labels = b.targets;
        f.origin = d;
      } else {
        f.from = invert_permutation(route_permutation(o_.seed, step, m, s - 1, place_.replicas, random_))[size_t(d)];
        f.origin = micro_batch_origin(o_.seed, step, m, s, d, place_.replicas, random_);
        auto in = activation_buffers();
        link_.recv(place_.worker(f.from, s - 1), {MessageKind::activations, step, m, s - 1, f.origin}, in);
        f.input = in[0].to(device_).requires_grad_(true);
        f.labels = in[1];
      }
      {
        shim::CudaBf16Autocast autocast(o_.bf16);
        f.output = stage_->forward(f.input);
        if (place_.last()) f.output = next_token_loss(f.output, f.labels.to(device_)) / double(M);
      }
      if (place_.last()) {
        loss_sum += f.output.item<double>();
      } else {
        link_.send(place_.worker(f.to, s + 1), {MessageKind::activations, step, m, s, f.origin},
                   {f.output.to(torch::kFloat32), f.labels});
      }
    };
    auto backward = [&](int64_t m) {
      auto& f = flights[size_t(m)];
      if (place_.last()) {
        f.output.backward();
      } else {
        std::vector<torch::Tensor> grad{hidden_buffer()};
        link_.recv(place_.worker(f.to, s + 1), {MessageKind::gradients, step, m, s, f.origin}, grad);
        f.output.backward(grad[0].to(device_));
      }
      if (!place_.first())
        link_.send(place_.worker(f.from, s - 1), {MessageKind::gradients, step, m, s - 1, f.origin},
                   {f.input.grad()});
      f = InFlight{};  // this micro-batch's activations are no longer needed
    };
    // Backward always in micro-batch order, so gradients accumulate in the
    // order of the unpipelined run under either schedule. GPipe runs every
    // forward first; 1F1B runs stages-1-s forwards ahead, then alternates, so
    // stage s holds at most stages-s micro-batches' activations. Every worker
    // of a stage follows the same order, so random routing cannot deadlock it.
    const int64_t ahead = one_f_one_b_ ? std::min<int64_t>(place_.stages - 1 - s, M) : M;
    int64_t forwards = 0;
    while (forwards < ahead) forward(forwards++);
    for (int64_t m = 0; m < M; ++m) {
      if (forwards < M) forward(forwards++);
      link_.note_micro_batches_held(forwards - m);
      backward(m);
    }
    link_.finish_sends();
    return place_.last() ? loss_sum : std::nan("");
  }

  // Always along the replica's own pipeline (fixed routing), so a replica's
  // validation loss is its own weights'.
  double evaluate() override {
    torch::NoGradGuard no_grad;
    const int s = place_.stage, d = place_.replica;
    const int64_t evaluation = evaluations_++;
    double sum = 0;
    for (int64_t i = 0; i < o_.eval_batches; ++i) {
      torch::Tensor x, labels;
      if (place_.first()) {
        auto b = data_.val.sample(uint64_t(i), 0, o_.batch);
        x = b.inputs.to(device_);
        labels = b.targets;
      } else {
        auto in = activation_buffers();
        link_.recv(place_.worker(d, s - 1), {MessageKind::evaluation, evaluation, i, s - 1, d}, in);
        x = in[0].to(device_);
        labels = in[1];
      }
      shim::CudaBf16Autocast autocast(o_.bf16);
      auto out = stage_->forward(x);
      if (place_.last()) {
        sum += next_token_loss(out, labels.to(device_)).item<double>();
      } else {
        link_.send(place_.worker(d, s + 1), {MessageKind::evaluation, evaluation, i, s, d},
                   {out.to(torch::kFloat32), labels});
      }
    }
    link_.finish_sends();
    return place_.last() ? sum / double(o_.eval_batches) : std::nan("");
  }

 private:
  torch::Tensor hidden_buffer() const {
    return torch::empty({o_.batch, stage_->config.context, stage_->config.hidden}, torch::kFloat32);
  }
  // What arrives from the previous stage: hidden states and the labels.
  std::vector<torch::Tensor> activation_buffers() const {
    return {hidden_buffer(), torch::empty({o_.batch, stage_->config.context}, torch::kInt64)};
  }

  StepOptions o_;
  StepData data_;
  torch::Device device_;
  PipelinePlace place_;
  ActivationLink& link_;
  bool random_;
  bool one_f_one_b_;
  StageModule stage_{nullptr};
  int64_t evaluations_ = 0;
};

}  // namespace

std::unique_ptr<WorkerModel> make_pipeline_stage(const ModelConfig& model, const PipelineConfig& pipeline,
                                                 const StepOptions& options, StepData data, torch::Device device,
                                                 PipelinePlace place, ActivationLink& link) {
  return std::make_unique<PipelineStage>(model, pipeline, options, data, device, place, link);
}

}  // namespace noloco
