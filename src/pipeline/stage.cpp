#include "pipeline/stage.h"

#include <string>
#include <vector>

#include <fmt/format.h>

#include "util/torch_shim.h"

namespace noloco {

StageModuleImpl::StageModuleImpl(LlamaForCausalLM& whole, LayerRange range, bool first, bool last)
    : config(whole->config) {
  // Plain containers named like the whole model's, so that parameter names,
  // checkpoints and exports stay in the Hugging Face layout.
  auto body = std::make_shared<torch::nn::Module>();
  auto layer_holder = std::make_shared<torch::nn::Module>();
  // Tied embeddings serve the first stage's input and the last stage's
  // output: one stage must hold both (train_config refuses stages > 1).
  TORCH_CHECK(!(whole->config.tied_embeddings && last && !first),
              "tied embeddings: the last stage would need the first stage's embedding matrix");
  if (first) embed_tokens = body->register_module("embed_tokens", whole->model->embed_tokens);
  for (int64_t i = range.first; i < range.end; ++i) {
    auto layer = whole->model->layers->ptr<DecoderLayerImpl>(size_t(i));
    layers.emplace_back(layer_holder->register_module(std::to_string(i), layer));
  }
  body->register_module("layers", layer_holder);
  if (last) norm = body->register_module("norm", whole->model->norm);
  register_module("model", body);
  if (last && whole->lm_head) lm_head = register_module("lm_head", whole->lm_head);
}

torch::Tensor StageModuleImpl::forward(const torch::Tensor& input) {
  auto x = embed_tokens ? embed_tokens(input) : input;
  const auto& tables = cached_rotary_tables(rope_, config, x);
  for (auto& layer : layers) x = layer->forward(x, tables);
  return norm ? vocabulary_logits(norm(x), lm_head, embed_tokens) : x;  // the last stage holds the norm
}

namespace {

class PipelineStage final : public WorkerModel {
 public:
  PipelineStage(const ModelConfig& arch, const PipelineConfig& pipeline, const StepOptions& options, StepData data,
                torch::Device device, PipelinePlace place, ActivationLink& link)
      : o_(options), data_(data), device_(device), place_(place), link_(link), random_(pipeline.routing == Routing::random),
        one_f_one_b_(pipeline.schedule == Schedule::one_f_one_b) {
    LlamaForCausalLM whole(arch);
    initialise_weights(whole, o_);
    const auto ranges = stage_layer_ranges(arch.layers, place.stages, pipeline.stage_layers);
    stage_ = StageModule(whole, ranges.at(size_t(place.stage)), place.first(), place.last());
    stage_->to(device);
  }

  torch::nn::Module& module() override { return *stage_; }
  bool computes_loss() const override { return place_.last(); }

  StepOutcome train_step(int64_t step) override {
    // One flight per route through this worker: one per micro-batch when
    // every worker is live; none, or several, for some micro-batches when the
    // routing goes around lost workers.
    struct Flight {
      int64_t micro = 0;
      int origin = 0, from = 0, to = 0;  // data replica; replicas of the previous and next stage
      torch::Tensor input, output, labels;
      bool dropped = false;
    };
    const int64_t M = o_.grad_accum;
    const int s = place_.stage, d = place_.replica;
    const auto& roster = link_.enter(fmt::format("step/{}", step));
    if (!roster.holds(s, self())) return {};  // restarted, and not routed to yet
    const auto live = live_replicas(roster);
    std::vector<std::vector<Flight>> flights(static_cast<size_t>(M));
    for (int64_t m = 0; m < M; ++m)
      for (const auto& r : live_routes(o_.seed, step, m, place_.replicas, live, random_))
        if (r.replica[size_t(s)] == d)
          flights[size_t(m)].push_back({m, r.origin, place_.first() ? d : r.replica[size_t(s - 1)],
                                        place_.last() ? d : r.replica[size_t(s + 1)]});
    auto activations = [&](const Flight& f, int boundary) {
      return ActivationHeader{MessageKind::activations, step, f.micro, boundary, f.origin};
    };
    auto gradients = [&](const Flight& f, int boundary) {
      return ActivationHeader{MessageKind::gradients, step, f.micro, boundary, f.origin};
    };
    double loss_sum = 0;
    int64_t completed = 0;
    auto forward = [&](int64_t m) {
      for (auto& f : flights[size_t(m)]) {
        // Every worker holds the data: the last stage takes the labels of the
        // micro-batch's origin itself, so they never cross the network.
        const auto batch = [&] { return data_.train.sample(uint64_t(step * M + m), f.origin * o_.batch, o_.batch); };
        if (place_.first()) {
          f.input = batch().inputs.to(device_);
        } else {
          std::vector<torch::Tensor> in{hidden_buffer()};
          if (!link_.recv(place_.worker(f.from, s - 1), activations(f, s - 1), in)) {
            f.dropped = true;
            if (!place_.last()) link_.send_dropped(place_.worker(f.to, s + 1), activations(f, s));
            continue;
          }
          f.input = in[0].to(device_).requires_grad_(true);
        }
        if (place_.last()) f.labels = batch().targets;
        {
          shim::CudaBf16Autocast autocast(o_.bf16);
          f.output = stage_->forward(f.input);
          if (place_.last()) f.output = next_token_loss(f.output, f.labels.to(device_)) / double(M);
        }
        if (place_.last()) {
          loss_sum += f.output.item<double>();
        } else {
          link_.send(place_.worker(f.to, s + 1), activations(f, s), {f.output.to(torch::kFloat32)});
        }
      }
    };
    auto backward = [&](int64_t m) {
      for (auto& f : flights[size_t(m)]) {
        if (f.dropped) continue;
        if (place_.last()) {
          f.output.backward();
        } else {
          std::vector<torch::Tensor> grad{hidden_buffer()};
          if (!link_.recv(place_.worker(f.to, s + 1), gradients(f, s), grad)) {
            if (!place_.first()) link_.send_dropped(place_.worker(f.from, s - 1), gradients(f, s - 1));
            f = Flight{};
            continue;
          }
          f.output.backward(grad[0].to(device_));
        }
        ++completed;
        if (!place_.first()) link_.send(place_.worker(f.from, s - 1), gradients(f, s - 1), {f.input.grad()});
        f = Flight{};  // this micro-batch's activations are no longer needed
      }
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
    if (completed == 0) return {};
    // Each micro-batch's loss was scaled by 1/M: make the gradient the mean
    // over the micro-batches this worker did complete.
    if (completed != M) {
      torch::NoGradGuard no_grad;
      for (auto& p : stage_->parameters())
        if (p.grad().defined()) p.grad().mul_(double(M) / double(completed));
    }
    const double loss = completed == M ? loss_sum : loss_sum * double(M) / double(completed);
    return {place_.last() ? loss : std::nan(""), completed};
  }

  // Along each replica's own pipeline (fixed routing), so a replica's
  // validation loss is its own weights'; a lost worker's place is taken by a
  // live worker of its stage.
  double evaluate(int64_t step) override {
    torch::NoGradGuard no_grad;
    const int s = place_.stage, d = place_.replica;
    const auto& roster = link_.roster() ? *link_.roster() : link_.enter(fmt::format("evaluation/{}", step));
    if (!roster.holds(s, self())) return std::nan("");
    std::vector<Route> mine;
    for (const auto& r : evaluation_routes(o_.seed, place_.replicas, live_replicas(roster)))
      if (r.replica[size_t(s)] == d) mine.push_back(r);
    double sum = 0;
    bool whole = true;
    for (int64_t i = 0; i < o_.eval_batches; ++i) {
      for (const auto& r : mine) {
        const ActivationHeader incoming{MessageKind::evaluation, step, i, s - 1, r.origin},
            outgoing{MessageKind::evaluation, step, i, s, r.origin};
        torch::Tensor x;
        if (place_.first()) {
          x = data_.val.sample(uint64_t(i), 0, o_.batch).inputs.to(device_);
        } else {
          std::vector<torch::Tensor> in{hidden_buffer()};
          if (!link_.recv(place_.worker(r.replica[size_t(s - 1)], s - 1), incoming, in)) {
            whole = false;
            if (!place_.last()) link_.send_dropped(place_.worker(r.replica[size_t(s + 1)], s + 1), outgoing);
            continue;
          }
          x = in[0].to(device_);
        }
        shim::CudaBf16Autocast autocast(o_.bf16);
        auto out = stage_->forward(x);
        if (place_.last()) {
          sum += next_token_loss(out, data_.val.sample(uint64_t(i), 0, o_.batch).targets.to(device_)).item<double>();
        } else {
          link_.send(place_.worker(r.replica[size_t(s + 1)], s + 1), outgoing, {out.to(torch::kFloat32)});
        }
      }
    }
    link_.finish_sends();
    return place_.last() && whole && !mine.empty() ? sum / double(o_.eval_batches) : std::nan("");
  }

  // The mean model's pass runs along replica 0's own pipeline, which exists only while no worker is lost.
  bool evaluates_mean_model(int group_rank) const override {
    return group_rank == 0 && link_.roster() && link_.roster()->whole(place_.replicas);
  }

 private:
  Peer self() const { return {place_.replica, link_.incarnation()}; }
  static LiveReplicas live_replicas(const Roster& roster) {
    LiveReplicas live;
    for (const auto& stage : roster.stages) {
      live.emplace_back();
      for (const auto& p : stage) live.back().push_back(p.rank);
    }
    return live;
  }
  torch::Tensor hidden_buffer() const {
    return torch::empty({o_.batch, stage_->config.context, stage_->config.hidden}, torch::kFloat32);
  }

  StepOptions o_;
  StepData data_;
  torch::Device device_;
  PipelinePlace place_;
  ActivationLink& link_;
  bool random_;
  bool one_f_one_b_;
  StageModule stage_{nullptr};
};

}  // namespace

std::unique_ptr<WorkerModel> make_pipeline_stage(const ModelConfig& model, const PipelineConfig& pipeline,
                                                 const StepOptions& options, StepData data, torch::Device device,
                                                 PipelinePlace place, ActivationLink& link) {
  return std::make_unique<PipelineStage>(model, pipeline, options, data, device, place, link);
}

}  // namespace noloco
