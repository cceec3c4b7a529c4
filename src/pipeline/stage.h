// One pipeline stage of one replica: a contiguous slice of the model's layers,
// run with the GPipe or 1F1B schedule, exchanging activations with the
// neighbouring stages of the replicas that the routing picks for each
// micro-batch among the step's live workers.
#pragma once
#include <memory>

#include <torch/torch.h>

#include "comm/membership/membership.h"
#include "comm/transport/peer_link.h"
#include "config/run_layout.h"
#include "config/train_config.h"
#include "model/llama.h"
#include "pipeline/activation_channel.h"
#include "pipeline/routing.h"
#include "pipeline/worker_model.h"

namespace noloco {

// Layers [range.first, range.end) of `whole`, with the embedding on the first
// stage and the final norm and head on the last. It shares (does not copy)
// the whole model's parameters and keeps their names: model.layers.<i>...
struct StageModuleImpl : torch::nn::Module {
  StageModuleImpl(LlamaForCausalLM& whole, LayerRange range, bool first, bool last);
  // Tokens [B, T] (first stage) or hidden states [B, T, hidden] in; hidden
  // states out, or logits on the last stage.
  torch::Tensor forward(const torch::Tensor& input);

  ModelConfig config;
  torch::nn::Embedding embed_tokens{nullptr};
  std::vector<DecoderLayer> layers;
  RMSNorm norm{nullptr};
  torch::nn::Linear lm_head{nullptr};  // none with tied embeddings

 private:
  RotaryTables rope_;
};
TORCH_MODULE(StageModule);

// Where this worker sits in the replicas x stages grid.
struct PipelinePlace {
  int replica = 0, replicas = 1, stage = 0, stages = 1;
  // The rank of the worker holding `at_stage` of replica `at_replica`.
  int worker(int at_replica, int at_stage) const {
    return RunLayout(stages, /*replica_workers=*/1).speaker(at_replica, at_stage);
  }
  bool first() const { return stage == 0; }
  bool last() const { return stage == stages - 1; }
};

// Builds the whole model from options.seed (so every stage starts from the
// weights the unpipelined run would), keeps this stage's slice and moves it to
// `device`. Its activation channel runs over `link` and `rosters` (the
// pipeline's liveness authority), both from the worker's connections.
std::unique_ptr<WorkerModel> make_pipeline_stage(const ModelConfig& model, const PipelineConfig& pipeline,
                                                 const StepOptions& options, StepData data, torch::Device device,
                                                 PipelinePlace place, PipelineRoster& rosters, PeerLink& link,
                                                 const ActivationCodecs& codecs);

}  // namespace noloco
