#include "optim/flat_params.h"

namespace noloco {

FlatParams::FlatParams(torch::nn::Module& module) {
  torch::NoGradGuard no_grad;
  auto params = module.named_parameters(/*recurse=*/true);
  int64_t total = 0;
  for (auto& p : params) total += p.value().numel();
  TORCH_CHECK(!params.is_empty(), "module has no parameters");
  const auto options = params[0].value().options();
  values_ = torch::empty({total}, options);
  grads_ = torch::zeros({total}, options);
  int64_t offset = 0;
  for (auto& p : params) {
    auto& t = p.value();
    TORCH_CHECK(t.options().dtype() == options.dtype() && t.device() == options.device(),
                "all parameters must share one dtype and device");
    const int64_t n = t.numel();
    auto value_view = values_.narrow(0, offset, n).view(t.sizes());
    value_view.copy_(t);
    t.set_data(value_view);
    // Autograd accumulates in place into an existing .grad, so gradients land in grads_.
    t.mutable_grad() = grads_.narrow(0, offset, n).view(t.sizes());
    named_.emplace_back(p.key(), t);
    offset += n;
  }
}

}  // namespace noloco
