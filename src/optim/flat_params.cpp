#include "optim/flat_params.h"

namespace noloco {

namespace {

std::vector<std::pair<std::string, torch::Tensor>> named_parameters(torch::nn::Module& module) {
  std::vector<std::pair<std::string, torch::Tensor>> named;
  for (auto& p : module.named_parameters(/*recurse=*/true)) named.emplace_back(p.key(), p.value());
  return named;
}

}  // namespace

FlatParams::FlatParams(torch::nn::Module& module) : FlatParams(named_parameters(module)) {}

FlatParams::FlatParams(std::vector<std::pair<std::string, torch::Tensor>> named) {
  torch::NoGradGuard no_grad;
  TORCH_CHECK(!named.empty(), "no parameters to take over");
  int64_t total = 0;
  for (const auto& p : named) total += p.second.numel();
  const auto options = named[0].second.options();
  values_ = torch::empty({total}, options);
  grads_ = torch::zeros({total}, options);
  int64_t offset = 0;
  for (auto& [name, t] : named) {
    TORCH_CHECK(t.options().dtype() == options.dtype() && t.device() == options.device(),
                "all parameters must share one dtype and device (", name, " differs)");
    const int64_t n = t.numel();
    auto value_view = values_.narrow(0, offset, n).view(t.sizes());
    value_view.copy_(t);
    t.set_data(value_view);
    // Autograd accumulates in place into an existing .grad, so gradients land in grads_.
    t.mutable_grad() = grads_.narrow(0, offset, n).view(t.sizes());
    named_.emplace_back(name, t);
    offsets_.push_back(offset);
    offset += n;
  }
}

void FlatParams::constrain(std::shared_ptr<const WeightConstraint> constraint) {
  constraint_ = std::move(constraint);
  torch::NoGradGuard no_grad;
  project_weights(values_);
}

void FlatParams::project_weights(torch::Tensor& flat) const {
  if (constraint_) constraint_->project_weights(flat);
}

void FlatParams::project_change(torch::Tensor& flat) const {
  if (constraint_) constraint_->project_change(flat);
}

}  // namespace noloco
