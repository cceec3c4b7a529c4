#include "pipeline/stage.h"

#include <string>
#include <vector>

#include <fmt/format.h>

#include "comm/store/run_record.h"
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
                torch::Device device, PipelinePlace place, PipelineRoster& rosters, PeerLink& link,
                const ActivationCodecs& codecs)
      : o_(options), data_(data), device_(device), place_(place),
        random_(pipeline.routing == Routing::random), one_f_one_b_(pipeline.schedule == Schedule::one_f_one_b) {
    LlamaForCausalLM whole(arch);
    initialise_weights(whole, o_);
    const auto ranges = stage_layer_ranges(arch.layers, place.stages, pipeline.stage_layers);
    // Every stage knows the initial embedding, so every stage can rebuild a
    // subspace boundary's hidden states. A seeded run's frozen part gets the
    // configured scale; an imported model keeps the one its layers read.
    if (o_.activation_subspace > 0)
      subspace_ = std::make_shared<const ResidualSubspace>(
          o_.activation_subspace, o_.seed, whole->model->embed_tokens->weight.to(device),
          /*constrained_layers=*/ranges.back().first, /*frozen_std=*/o_.subspace_token_std);
    channel_ = std::make_unique<ActivationChannel>(rosters, link, place.stages, codecs, subspace_);
    stage_ = StageModule(whole, ranges.at(size_t(place.stage)), place.first(), place.last());
    stage_->to(device);
  }

  torch::nn::Module& module() override { return *stage_; }
  std::shared_ptr<const ResidualSubspace> residual_subspace() const override { return subspace_; }
  bool computes_loss() const override { return place_.last(); }
  std::optional<PipelineStats> pipeline_stats() const override { return channel_->stats(); }
  void leave_pipeline() override { channel_->leave(); }
  bool listed() const override { return channel_->listed(); }

  StepOutcome train_step(int64_t step) override {
    const auto& roster = channel_->enter(record::step_roster(step));
    if (!roster.holds(place_.stage, self())) return {};  // restarted, and not routed to yet
    auto flights = flights_through_here(step, roster);
    Tally tally;
    // Backward always in micro-batch order, so gradients accumulate in the
    // order of the unpipelined run under either schedule. GPipe runs every
    // forward first; 1F1B runs stages-1-s forwards ahead, then alternates, so
    // stage s holds at most stages-s micro-batches' activations. Every worker
    // of a stage follows the same order, so random routing cannot deadlock it.
    const int64_t M = o_.grad_accum;
    const int64_t ahead = one_f_one_b_ ? std::min<int64_t>(place_.stages - 1 - place_.stage, M) : M;
    int64_t forwards = 0;
    for (; forwards < ahead; ++forwards) forward(step, flights[size_t(forwards)], tally);
    for (int64_t m = 0; m < M; ++m) {
      if (forwards < M) forward(step, flights[size_t(forwards++)], tally);
      channel_->note_micro_batches_held(forwards - m);
      backward(step, flights[size_t(m)], tally);
    }
    channel_->finish_sends();
    return outcome(tally);
  }

  // Along each replica's own pipeline (fixed routing), so a replica's
  // validation loss is its own weights'; a lost worker's place is taken by a
  // live worker of its stage.
  double evaluate(int64_t step) override {
    torch::NoGradGuard no_grad;
    const int s = place_.stage, d = place_.replica;
    const auto& roster = channel_->roster() ? *channel_->roster() : channel_->enter(record::evaluation_roster(step));
    if (!roster.holds(s, self())) return std::nan("");
    std::vector<Route> mine;
    for (const auto& r : evaluation_routes(o_.seed, place_.replicas, live_replicas(roster)))
      if (r.replica[size_t(s)] == d) mine.push_back(r);
    double sum = 0;
    bool whole = true;
    for (int64_t i = 0; i < o_.eval_batches; ++i) {
      const auto batch = [&] { return data_.val.sample(uint64_t(i), 0, o_.eval_batch); };
      for (const auto& r : mine) {
        const int from = place_.first() ? -1 : place_.worker(r.replica[size_t(s - 1)], s - 1);
        const int to = place_.last() ? -1 : place_.worker(r.replica[size_t(s + 1)], s + 1);
        const ActivationHeader incoming{MessageKind::evaluation, step, i, s - 1, r.origin},
            outgoing{MessageKind::evaluation, step, i, s, r.origin};
        const auto x = place_.first() ? batch().inputs.to(device_) : receive_or_pass_drop(from, incoming, to, outgoing);
        if (!x.defined()) {
          whole = false;
          continue;
        }
        shim::CudaBf16Autocast autocast(o_.bf16);
        auto out = stage_->forward(x);
        if (place_.last())
          sum += next_token_loss(out, batch().targets.to(device_)).item<double>();
        else
          channel_->send(to, outgoing, {out.to(torch::kFloat32)});
      }
    }
    channel_->finish_sends();
    return place_.last() && whole && !mine.empty() ? sum / double(o_.eval_batches) : std::nan("");
  }

  // The mean model's pass runs along replica 0's own pipeline, which exists only while no worker is lost.
  bool evaluates_mean_model(int group_rank) const override {
    return group_rank == 0 && channel_->roster() && channel_->roster()->whole(place_.replicas);
  }

 private:
  Peer self() const { return {place_.replica, channel_->incarnation()}; }
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

  // One flight per route through this worker: one per micro-batch when
  // every worker is live; none, or several, for some micro-batches when the
  // routing goes around lost workers.
  struct Flight {
    int64_t micro = 0;
    int origin = 0, from = -1, to = -1;  // data replica; workers of the previous and next stage (-1: none)
    torch::Tensor input, output;
    bool dropped = false;
  };
  struct Tally {
    double loss_sum = 0;
    int64_t completed = 0;
  };

  // By micro-batch: the flights routed through this worker at `step`.
  std::vector<std::vector<Flight>> flights_through_here(int64_t step, const Roster& roster) const {
    const int s = place_.stage, d = place_.replica;
    const auto live = live_replicas(roster);
    std::vector<std::vector<Flight>> flights(size_t(o_.grad_accum));
    for (int64_t m = 0; m < o_.grad_accum; ++m)
      for (const auto& r : live_routes(o_.seed, step, m, place_.replicas, live, random_))
        if (r.replica[size_t(s)] == d)
          flights[size_t(m)].push_back({m, r.origin, place_.first() ? -1 : place_.worker(r.replica[size_t(s - 1)], s - 1),
                                        place_.last() ? -1 : place_.worker(r.replica[size_t(s + 1)], s + 1)});
    return flights;
  }

  // What worker `from` sends as `expected`, on this device; undefined if the
  // micro-batch was dropped on the way, and then worker `to` (-1: none) is
  // told that `onward` will not come either. `ids`: the micro-batch's tokens
  // (training activations through a residual subspace are rebuilt from them).
  torch::Tensor receive_or_pass_drop(int from, const ActivationHeader& expected, int to, const ActivationHeader& onward,
                                     const torch::Tensor& ids = {}) {
    std::vector<torch::Tensor> in{hidden_buffer()};
    if (channel_->recv(from, expected, in, ids)) return in[0].to(device_);
    if (to >= 0) channel_->send_dropped(to, onward);
    return {};
  }

  void forward(int64_t step, std::vector<Flight>& flights, Tally& tally) {
    const int s = place_.stage;
    const int64_t M = o_.grad_accum;
    for (auto& f : flights) {
      // Every worker holds the data: the last stage takes the labels of the
      // micro-batch's origin itself, so they never cross the network.
      const auto batch = [&] { return data_.train.sample(uint64_t(step * M + f.micro), f.origin * o_.batch, o_.batch); };
      const ActivationHeader incoming{MessageKind::activations, step, f.micro, s - 1, f.origin},
          outgoing{MessageKind::activations, step, f.micro, s, f.origin};
      if (place_.first()) {
        f.input = batch().inputs.to(device_);
      } else {
        f.input = receive_or_pass_drop(f.from, incoming, f.to, outgoing, subspace_ ? batch().inputs : torch::Tensor());
        if (!f.input.defined()) {
          f.dropped = true;
          continue;
        }
        f.input.requires_grad_(true);
      }
      {
        shim::CudaBf16Autocast autocast(o_.bf16);
        f.output = stage_->forward(f.input);
        if (place_.last()) f.output = next_token_loss(f.output, batch().targets.to(device_)) / double(M);
      }
      if (place_.last())
        tally.loss_sum += f.output.item<double>();
      else
        channel_->send(f.to, outgoing, {f.output.to(torch::kFloat32)});
    }
  }

  void backward(int64_t step, std::vector<Flight>& flights, Tally& tally) {
    const int s = place_.stage;
    for (auto& f : flights) {
      const ActivationHeader incoming{MessageKind::gradients, step, f.micro, s, f.origin},
          outgoing{MessageKind::gradients, step, f.micro, s - 1, f.origin};
      if (f.dropped) continue;
      if (place_.last()) {
        f.output.backward();
      } else {
        const auto grad = receive_or_pass_drop(f.to, incoming, f.from, outgoing);
        if (!grad.defined()) {
          f = Flight{};
          continue;
        }
        f.output.backward(grad);
      }
      ++tally.completed;
      if (!place_.first()) channel_->send(f.from, outgoing, {f.input.grad()});
      f = Flight{};  // this micro-batch's activations are no longer needed
    }
  }

  // Each micro-batch's loss was scaled by 1/M: the gradient becomes the mean
  // over the micro-batches this worker did complete.
  StepOutcome outcome(const Tally& tally) {
    const int64_t M = o_.grad_accum;
    if (tally.completed == 0) return {};
    if (tally.completed != M) {
      torch::NoGradGuard no_grad;
      for (auto& p : stage_->parameters())
        if (p.grad().defined()) p.grad().mul_(double(M) / double(tally.completed));
    }
    const double loss = tally.completed == M ? tally.loss_sum : tally.loss_sum * double(M) / double(tally.completed);
    return {place_.last() ? loss : std::nan(""), tally.completed};
  }

  StepOptions o_;
  StepData data_;
  torch::Device device_;
  PipelinePlace place_;
  std::shared_ptr<const ResidualSubspace> subspace_;
  std::unique_ptr<ActivationChannel> channel_;
  bool random_;
  bool one_f_one_b_;
  StageModule stage_{nullptr};
};

}  // namespace

std::unique_ptr<WorkerModel> make_pipeline_stage(const ModelConfig& model, const PipelineConfig& pipeline,
                                                 const StepOptions& options, StepData data, torch::Device device,
                                                 PipelinePlace place, PipelineRoster& rosters, PeerLink& link,
                                                 const ActivationCodecs& codecs) {
  return std::make_unique<PipelineStage>(model, pipeline, options, data, device, place, rosters, link, codecs);
}

}  // namespace noloco
