// What one worker computes in a step: the whole model, or one pipeline stage
// that exchanges activations with neighbouring stages (pipeline/stage.h).
// The training loop is the same for both.
#pragma once
#include <cmath>
#include <memory>
#include <optional>
#include <string>

#include <torch/torch.h>

#include "data/dataset.h"
#include "model/llama.h"
#include "model/subspace.h"
#include "pipeline/pipeline_stats.h"

namespace noloco {

// What a worker's step produced.
struct StepOutcome {
  double loss = std::nan("");  // mean over its micro-batches; NaN where the loss is not computed
  // Micro-batches whose gradients it accumulated: grad_accum, or fewer (or
  // more) on a pipeline worker when workers were lost; 0: nothing to apply.
  int64_t micro_batches = 0;
};

class WorkerModel {
 public:
  virtual ~WorkerModel() = default;
  // The parameters this worker owns, named as in the whole model.
  virtual torch::nn::Module& module() = 0;
  // Accumulates the gradients of step `step` (the mean over its micro-batches).
  virtual StepOutcome train_step(int64_t step) = 0;
  // Mean validation loss over eval_batches after step `step`, NaN where not computed.
  virtual double evaluate(int64_t step) = 0;
  // Whether train_step and evaluate return losses here.
  virtual bool computes_loss() const { return true; }
  // Whether this worker, as member `group_rank` of the evaluation group of
  // its replicas, evaluates their mean model (all workers that do must form
  // whole pipelines).
  virtual bool evaluates_mean_model(int group_rank) const { return group_rank == 0; }
  // The whole model, where this worker holds all of it (for samples).
  virtual LlamaForCausalLM* whole_model() { return nullptr; }
  // The subspace its residual-stream writes are kept in (activation_subspace); null: none.
  virtual std::shared_ptr<const ResidualSubspace> residual_subspace() const { return nullptr; }
  // A pipeline stage's traffic with its neighbours; none for the whole model.
  virtual std::optional<PipelineStats> pipeline_stats() const { return std::nullopt; }
  // The worker leaves the run: rosters that leave it out are expected from now on.
  virtual void leave_pipeline() {}
  // Whether the step's roster routes micro-batches through this worker.
  virtual bool listed() const { return false; }
};

// Windows for training (sliced per replica) and validation (the same on all).
struct StepData {
  const WindowSampler& train;
  const WindowSampler& val;
  int replica = 0;
};

// The shape of a step and how it is computed.
struct StepOptions {
  int64_t batch = 1;       // sequences per micro-batch
  int64_t grad_accum = 1;  // micro-batches per step
  int64_t eval_batches = 1;
  // Sequences per validation batch: a replica's, whichever of its workers evaluates
  // (batch × replica_workers), so the measurement does not depend on how a replica is split.
  int64_t eval_batch = 1;
  bool bf16 = false;   // CUDA autocast
  uint64_t seed = 0;   // weight initialisation
  std::string init_from;  // or a Hugging Face directory's weights
  int64_t activation_subspace = 0;  // K (model/subspace.h); 0: none
  double subspace_token_std = 0;    // the frozen part's std; 0: E₀'s (an imported model's always)
};

// The weights a run starts from: HF's initialisation from options.seed, or
// options.init_from's weights.
void initialise_weights(LlamaForCausalLM& model, const StepOptions& options);

// The unpipelined model, initialised from options.seed, on `device`.
std::unique_ptr<WorkerModel> make_whole_model(const ModelConfig& model, const StepOptions& options, StepData data,
                                              torch::Device device);

}  // namespace noloco
