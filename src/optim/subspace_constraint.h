// activation_subspace on the flat weights: the residual-stream writers
// (model/subspace.h) kept in span(U) wherever a full copy of the weights
// changes — after each inner step (θ), after each outer step (θ, φ, the
// outer momentum) — and their gradients projected before AdamW sees them.
//
// What that does to AdamW: projected gradients keep the first moment in the
// span (it is linear in them); the second moment stays as it is, a positive
// per-value scale the span has no meaning for. The update m̂/(√v̂ + ε) then
// leans slightly out of the span, and the weight projection after the step
// removes that lean: AdamW's step, restricted to the span. Weight decay
// shrinks the frozen part F of the embedding too; the projection restores it,
// so decay acts on the trained part only.
#pragma once
#include <memory>
#include <vector>

#include "model/subspace.h"
#include "optim/flat_params.h"

namespace noloco {

class SubspaceConstraint final : public WeightConstraint {
 public:
  // The parameters of `params` it constrains, found by their Hugging Face
  // names: the o_proj and down_proj weights of the layers the subspace
  // constrains, and the token embedding.
  SubspaceConstraint(std::shared_ptr<const ResidualSubspace> subspace, const FlatParams& params);
  void project_weights(torch::Tensor& flat) const override { project(flat, false); }
  void project_change(torch::Tensor& flat) const override { project(flat, true); }
  // How many parameters it constrains (a stage holds only some of them).
  size_t constrained() const { return targets_.size(); }

 private:
  void project(torch::Tensor& flat, bool is_change) const;
  struct Target {
    int64_t offset, rows, cols;
    bool embedding;
  };
  std::shared_ptr<const ResidualSubspace> subspace_;
  std::vector<Target> targets_;
};

}  // namespace noloco
