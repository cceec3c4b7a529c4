#include "optim/outer.h"

#include <algorithm>

namespace noloco {

void outer_momentum_step(torch::Tensor& phi, torch::Tensor& momentum, torch::Tensor& theta,
                         const torch::Tensor& mean_delta, const torch::Tensor& mean_phi, double alpha,
                         double beta, double gamma) {
  torch::NoGradGuard no_grad;
  momentum.mul_(alpha).add_(mean_delta, beta);
  if (mean_phi.defined()) momentum.add_(mean_phi - phi, gamma);
  phi.add_(momentum);
  theta.copy_(phi);
}

namespace {

class NoOuter final : public OuterOptimizer {};

// Fully synchronous data parallelism: the flat gradient buffer is one all-reduce per step.
class Ddp final : public OuterOptimizer {
 public:
  explicit Ddp(Communicator& comm) : comm_(comm) {}
  void on_gradients(FlatParams& p) override { comm_.all_reduce_mean(p.grads()); }

 private:
  Communicator& comm_;
};

// DiLoCo and NoLoCo: slow weights φ and momentum m, an outer step every H
// inner steps. They differ only in who is averaged with and what is sent.
class SlowWeights final : public OuterOptimizer {
 public:
  SlowWeights(const TrainConfig& c, Communicator& comm, FlatParams& p)
      : c_(c), comm_(comm), phi_(p.values().detach().clone()), momentum_(torch::zeros_like(phi_)) {
    all_.resize(size_t(comm.world()));
    for (int r = 0; r < comm.world(); ++r) all_[size_t(r)] = r;
  }

  std::optional<OuterSync> after_inner_step(int64_t step, FlatParams& p) override {
    if ((step + 1) % c_.outer_interval != 0) return std::nullopt;
    OuterSync sync;
    sync.outer_step = (step + 1) / c_.outer_interval - 1;
    auto& theta = p.values();
    torch::NoGradGuard no_grad;
    if (c_.method == "diloco") {
      auto delta = theta - phi_;
      comm_.all_reduce_mean(delta);
      outer_momentum_step(phi_, momentum_, theta, delta, {}, c_.outer_momentum, c_.outer_lr, 0.0);
      sync.group = sync.arrived = all_;
      return sync;
    }
    const auto groups = noloco_groups(c_.seed, sync.outer_step, comm_.members(sync.outer_step), int(c_.group_size));
    const auto mine = std::find_if(groups.begin(), groups.end(), [&](const std::vector<int>& g) {
      return std::find(g.begin(), g.end(), comm_.rank()) != g.end();
    });
    sync.group = mine != groups.end() ? *mine : std::vector<int>{comm_.rank()};  // left out this time: alone
    if (c_.gamma == c_.outer_lr) {
      // β·mean(Δ) + β·(mean φ − φ_i) = β·(mean θ − φ_i): only θ travels.
      auto mean_theta = comm_.group_mean(wire(theta), sync.group, sync.outer_step, &sync.arrived);
      outer_momentum_step(phi_, momentum_, theta, mean_theta - phi_, {}, c_.outer_momentum, c_.outer_lr, 0.0);
    } else {
      const int64_t n = phi_.numel();
      auto both = comm_.group_mean(wire(torch::cat({theta - phi_, phi_})), sync.group, sync.outer_step,
                                  &sync.arrived);
      outer_momentum_step(phi_, momentum_, theta, both.narrow(0, 0, n), both.narrow(0, n, n), c_.outer_momentum,
                          c_.outer_lr, c_.gamma);
    }
    return sync;
  }

  void save(TensorMap& out) const override {
    out["outer.phi"] = phi_;
    out["outer.momentum"] = momentum_;
  }
  void load(const TensorMap& in) override {
    auto phi = in.find("outer.phi"), m = in.find("outer.momentum");
    TORCH_CHECK(phi != in.end() && m != in.end(), "checkpoint lacks the outer optimizer state");
    TORCH_CHECK(phi->second.numel() == phi_.numel() && m->second.numel() == phi_.numel(),
                "checkpoint outer state has the wrong size");
    phi_.copy_(phi->second);
    momentum_.copy_(m->second);
  }

 private:
  torch::Tensor wire(const torch::Tensor& t) const {
    return c_.wire_dtype == "bf16" ? t.to(torch::kBFloat16) : t;
  }

  const TrainConfig& c_;
  Communicator& comm_;
  torch::Tensor phi_, momentum_;
  std::vector<int> all_;
};

}  // namespace

std::unique_ptr<OuterOptimizer> make_outer_optimizer(const TrainConfig& c, Communicator* comm,
                                                     FlatParams& params) {
  if (c.method == "none") return std::make_unique<NoOuter>();
  TORCH_CHECK(comm != nullptr, "method ", c.method, " needs a communicator");
  if (c.method == "ddp") return std::make_unique<Ddp>(*comm);
  return std::make_unique<SlowWeights>(c, *comm, params);
}

}  // namespace noloco
