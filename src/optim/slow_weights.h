// What DiLoCo and NoLoCo share: slow weights φ and outer momentum m, an
// outer step every H inner steps, and the momentum step
//   m ← α·m + β·mean_delta + γ·(mean_phi − φ);  φ ← φ + m;  θ ← φ
// Each method only says how its replicas compute mean_delta and mean_phi
// (torchft's LocalSGD/DiLoCo split: the algorithm overrides one sync method).
//
// Two schedules change when that happens, not what it computes
// (docs/method.md has the math):
//  - fragments=F (Streaming DiLoCo): the flat weights in F contiguous
//    fragments, fragment f synchronised at inner steps ((f+1)·H/F) mod H of
//    every period, so each exchange is F times smaller and they spread out.
//  - overlap=true: the exchange of a period runs on a background thread while
//    the next period trains, and is applied one period late, keeping the
//    local progress made meanwhile: θ ← φ_new + (θ − θ_start). Checkpoints and
//    state hand-overs wait for the exchange in flight and keep its result.
//    With eager=true each replica meanwhile trains from its own outer step
//    θ_start = φ + α·m + β·Δ_own, which the late result replaces.
//  - pace=speed (optim/pace.h): each replica trains only as many of a
//    period's inner steps as its speed allows; its message carries how many.
#pragma once
#include <functional>
#include <future>
#include <memory>
#include <vector>

#include "optim/outer.h"

namespace noloco {

// The averages an exchange produced; mean_phi undefined: no pull term.
// `kept` (residual=weights): what this replica's own message left out,
// which stays in its weights: θ ← φ + kept instead of θ ← φ.
struct OuterTerms {
  torch::Tensor mean_delta, mean_phi;
  double gamma = 0;
  torch::Tensor kept;
};

// The outer momentum step above, in fp32, in place.
void outer_momentum_step(torch::Tensor& phi, torch::Tensor& momentum, torch::Tensor& theta, const OuterTerms& terms,
                         double alpha, double beta);

// A contiguous slice of the flat parameters synchronised on its own schedule.
struct Fragment {
  int index = 0;
  int64_t offset = 0, numel = 0;
};
// `count` near-equal fragments of `numel` values; throws if count is out of [1, numel].
std::vector<Fragment> split_fragments(int64_t numel, int64_t count);
// The fragment due after inner step `step` (0-based) with period H among
// `count` fragments, and its synchronisation index; nullopt if none is due.
std::optional<std::pair<int, int64_t>> fragment_due(int64_t step, int64_t period, int64_t count);

// Runs exchanges one at a time, in submission order, on one background thread.
class ExchangeThread {
 public:
  ExchangeThread();
  ~ExchangeThread();
  ExchangeThread(const ExchangeThread&) = delete;
  ExchangeThread& operator=(const ExchangeThread&) = delete;
  template <class F>
  auto submit(F job) -> std::future<decltype(job())> {
    auto task = std::make_shared<std::packaged_task<decltype(job())()>>(std::move(job));
    auto result = task->get_future();
    post([task] { (*task)(); });
    return result;
  }

 private:
  void post(std::function<void()> job);
  struct State;
  std::unique_ptr<State> state_;
};

class SlowWeightsMethod : public OuterOptimizer {
 public:
  SlowWeightsMethod(const OuterConfig& config, FlatParams& params, int rank);
  ~SlowWeightsMethod() override;
  std::optional<OuterSync> after_inner_step(int64_t step, FlatParams& params) final;
  std::vector<OuterSync> finish(FlatParams& params) final;
  void save(TensorMap& out) const override;
  void load(const TensorMap& in) override;
  Pace* pace() override { return pace_.get(); }

 protected:
  // The means over this replica's group (mean Δ, and mean φ for a pull) from
  // the exchange of `fragment` (all the weights without fragments) named
  // `exchange_id` (the same on every replica), over this replica's θ and φ of
  // that fragment. With overlap it runs on the exchange thread, on copies.
  // With pace=speed, sync.pace is this replica's report, which the means
  // weigh by and its message carries; the partners' go to sync.partners_pace.
  virtual OuterTerms group_means(int64_t exchange_id, const Fragment& fragment, const torch::Tensor& theta,
                                 const torch::Tensor& phi, OuterSync& sync) = 0;
  const std::vector<Fragment>& fragments() const { return fragments_; }
  // Lets an exchange in flight end. A method's destructor calls it first:
  // the exchange uses the method's own members, gone once its body has run.
  void end_exchanges() { thread_.reset(); }
  // State names of per-fragment state: `name`, or `name`.f<k> with fragments.
  std::string fragment_state(const std::string& name, const Fragment& f) const;
  const OuterConfig& config_;

 private:
  struct Result {
    OuterTerms terms;
    OuterSync sync;
  };
  // Overlap: the exchange in flight of each fragment, or its result once a
  // checkpoint or hand-over waited for it.
  struct Pending {
    std::future<Result> future;
    std::optional<Result> result;
    bool active() const { return future.valid() || result.has_value(); }
  };
  Result wait(Pending& p) const;
  // Applies a delayed result to fragment f: φ, m updated; θ ← φ + (θ − θ_start).
  void apply_late(const Fragment& f, const OuterTerms& terms, torch::Tensor& theta);
  // After an outer step: a decoded mean (lossy codes, sparse messages) may
  // leave the weights' constraint (FlatParams::constrain); θ, φ and the
  // momentum are projected back onto it whole, since a fragment may cut a
  // constrained matrix.
  void keep_constraint(FlatParams& params);
  // pace=speed: the partners' reports of an outer step now applied.
  void hear_partners(const OuterSync& sync);

  std::vector<Fragment> fragments_;
  torch::Tensor phi_, momentum_;
  torch::Tensor start_;  // overlap: θ at the start of each fragment's current period
  mutable std::vector<Pending> pending_;
  std::unique_ptr<ExchangeThread> thread_;
  std::unique_ptr<Pace> pace_;
};

}  // namespace noloco
