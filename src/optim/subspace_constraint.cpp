#include "optim/subspace_constraint.h"

#include <cstdlib>

#include "util/files.h"

namespace noloco {

namespace {

// The layer of a parameter named model.layers.<i>....; -1 for any other.
int64_t layer_of(const std::string& name) {
  const std::string prefix = "model.layers.";
  if (name.rfind(prefix, 0) != 0) return -1;
  return std::strtoll(name.c_str() + prefix.size(), nullptr, 10);
}

}  // namespace

SubspaceConstraint::SubspaceConstraint(std::shared_ptr<const ResidualSubspace> subspace, const FlatParams& params)
    : subspace_(std::move(subspace)) {
  const auto& named = params.named();
  for (size_t i = 0; i < named.size(); ++i) {
    const auto& [name, t] = named[i];
    const bool embedding = name == "model.embed_tokens.weight";
    const bool writer = ends_with(name, ".self_attn.o_proj.weight") || ends_with(name, ".mlp.down_proj.weight");
    if (!embedding && !(writer && subspace_->constrains_layer(layer_of(name)))) continue;
    targets_.push_back({params.offset(i), t.size(0), t.size(1), embedding});
  }
}

void SubspaceConstraint::project(torch::Tensor& flat, bool is_change) const {
  torch::NoGradGuard no_grad;
  for (const auto& t : targets_) {
    auto matrix = flat.narrow(0, t.offset, t.rows * t.cols).view({t.rows, t.cols});
    if (t.embedding)
      subspace_->project_embedding(matrix, is_change);
    else
      subspace_->project_columns(matrix);
  }
}

}  // namespace noloco
