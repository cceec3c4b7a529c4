#include "optim/slow_weights.h"

#include <condition_variable>
#include <deque>
#include <mutex>
#include <optional>
#include <thread>

#include <fmt/format.h>

namespace noloco {

namespace {

// m ← α·m + β·mean_delta + γ·(mean_phi − φ);  φ ← φ + m
void momentum_update(torch::Tensor& phi, torch::Tensor& momentum, const OuterTerms& terms, double alpha, double beta) {
  momentum.mul_(alpha).add_(terms.mean_delta, beta);
  if (terms.mean_phi.defined()) momentum.add_(terms.mean_phi - phi, terms.gamma);
  phi.add_(momentum);
}

struct SavedPending {
  int64_t outer_step = 0;
  bool has_phi = false;
};

// What a state map says was pending for one fragment: the outer step of the
// saved result, and whether it holds a φ mean. Checkpoints written before
// 2026-11 said it in a float64 flags tensor {pending, has φ, outer step}.
std::optional<SavedPending> saved_pending(const TensorMap& in, const std::string& outer_step, const std::string& phi,
                                          const std::string& legacy_flags) {
  if (const auto it = in.find(outer_step); it != in.end() && it->second.numel() == 1)
    return SavedPending{it->second.reshape({1})[0].item<int64_t>(), in.count(phi) > 0};
  if (const auto it = in.find(legacy_flags); it != in.end() && it->second.numel() == 3) {
    const auto flags = it->second.to(torch::kFloat64);
    if (flags[0].item<double>() != 0) return SavedPending{int64_t(flags[2].item<double>()), flags[1].item<double>() != 0};
  }
  return std::nullopt;
}

}  // namespace

void outer_momentum_step(torch::Tensor& phi, torch::Tensor& momentum, torch::Tensor& theta, const OuterTerms& terms,
                         double alpha, double beta) {
  torch::NoGradGuard no_grad;
  momentum_update(phi, momentum, terms, alpha, beta);
  theta.copy_(phi);
  if (terms.kept.defined()) theta.add_(terms.kept);
}

std::vector<Fragment> split_fragments(int64_t numel, int64_t count) {
  if (count < 1 || count > numel)
    throw std::invalid_argument(fmt::format("fragments must be in [1, {}], got {}", numel, count));
  std::vector<Fragment> out;
  int64_t offset = 0;
  for (int64_t f = 0; f < count; ++f) {
    const int64_t n = numel / count + (f < numel % count ? 1 : 0);
    out.push_back({int(f), offset, n});
    offset += n;
  }
  return out;
}

std::optional<std::pair<int, int64_t>> fragment_due(int64_t step, int64_t period, int64_t count) {
  const int64_t done = step + 1;
  for (int64_t f = 0; f < count; ++f) {
    const int64_t first = ((f + 1) * period) / count;  // fragment f's first synchronisation, after `first` steps
    if (done >= first && (done - first) % period == 0) return std::make_pair(int(f), (done - first) / period);
  }
  return std::nullopt;
}

struct ExchangeThread::State {
  std::mutex mutex;
  std::condition_variable wake;
  std::deque<std::function<void()>> jobs;
  bool stop = false;
  std::thread thread;
};

ExchangeThread::ExchangeThread() : state_(std::make_unique<State>()) {
  state_->thread = std::thread([s = state_.get()] {
    for (;;) {
      std::function<void()> job;
      {
        std::unique_lock<std::mutex> lock(s->mutex);
        s->wake.wait(lock, [&] { return s->stop || !s->jobs.empty(); });
        if (s->jobs.empty()) return;  // stopping, and nothing left to run
        job = std::move(s->jobs.front());
        s->jobs.pop_front();
      }
      job();
    }
  });
}

ExchangeThread::~ExchangeThread() {
  {
    std::lock_guard<std::mutex> lock(state_->mutex);
    state_->stop = true;
  }
  state_->wake.notify_one();
  state_->thread.join();
}

void ExchangeThread::post(std::function<void()> job) {
  {
    std::lock_guard<std::mutex> lock(state_->mutex);
    state_->jobs.push_back(std::move(job));
  }
  state_->wake.notify_one();
}

SlowWeightsMethod::SlowWeightsMethod(const OuterConfig& config, FlatParams& params, int rank)
    : config_(config),
      fragments_(split_fragments(params.numel(), config.fragments)),
      phi_(params.values().detach().clone()),
      momentum_(torch::zeros_like(phi_)),
      pace_(config.pace == PaceMode::speed ? std::make_unique<Pace>(config.interval, rank) : nullptr) {
  if (config.fragments > config.interval)
    throw std::invalid_argument(fmt::format("fragments ({}) must not exceed outer_interval ({})", config.fragments,
                                            config.interval));
  if (!config.overlap) return;
  start_ = phi_.clone();
  pending_.resize(fragments_.size());
  thread_ = std::make_unique<ExchangeThread>();
}

SlowWeightsMethod::~SlowWeightsMethod() { end_exchanges(); }

std::string SlowWeightsMethod::fragment_state(const std::string& name, const Fragment& f) const {
  return fragments_.size() == 1 ? name : fmt::format("{}.f{}", name, f.index);
}

SlowWeightsMethod::Result SlowWeightsMethod::wait(Pending& p) const {
  if (!p.result) p.result = p.future.get();
  return *p.result;
}

void SlowWeightsMethod::apply_late(const Fragment& f, const OuterTerms& terms, torch::Tensor& theta) {
  auto phi = phi_.narrow(0, f.offset, f.numel), momentum = momentum_.narrow(0, f.offset, f.numel);
  const auto progress = theta - start_.narrow(0, f.offset, f.numel);  // made while the exchange was in flight
  momentum_update(phi, momentum, terms, config_.momentum, config_.lr);
  theta.copy_(phi + progress);
  if (terms.kept.defined()) theta.add_(terms.kept);
}

std::optional<OuterSync> SlowWeightsMethod::after_inner_step(int64_t step, FlatParams& params) {
  const auto due = fragment_due(step, config_.interval, int64_t(fragments_.size()));
  if (!due) return std::nullopt;
  const Fragment f = fragments_[size_t(due->first)];
  const int64_t outer_step = due->second, id = outer_step * int64_t(fragments_.size()) + f.index;
  torch::NoGradGuard no_grad;
  auto theta = params.values().narrow(0, f.offset, f.numel);
  auto phi = phi_.narrow(0, f.offset, f.numel), momentum = momentum_.narrow(0, f.offset, f.numel);
  OuterSync sync;
  sync.outer_step = outer_step;
  sync.fragment = f.index;
  if (pace_) sync.pace = pace_->report(outer_step);
  if (!config_.overlap) {
    const auto terms = group_means(id, f, theta, phi, sync);
    outer_momentum_step(phi, momentum, theta, terms, config_.momentum, config_.lr);
    keep_constraint(params);
    hear_partners(sync);
    return sync;
  }
  // Overlap: apply the exchange of the last period, then start this period's.
  std::optional<OuterSync> applied;
  auto& pending = pending_[size_t(f.index)];
  if (pending.active()) {
    const auto r = wait(pending);
    apply_late(f, r.terms, theta);
    hear_partners(r.sync);
    applied = r.sync;
    pending = Pending{};
  }
  pending.future = thread_->submit([this, id, f, sync, theta = theta.clone(), phi = phi.clone()] {
    Result r;
    r.sync = sync;
    r.terms = group_means(id, f, theta, phi, r.sync);
    return r;
  });
  // Eager: the outer step with this replica's own Δ (and no pull: the partners'
  // φ is not known yet) now, so the next period trains from where the outer
  // step will roughly be; apply_late swaps it for the real one.
  if (config_.eager) theta.copy_(phi + config_.momentum * momentum + config_.lr * (theta - phi));
  keep_constraint(params);
  start_.narrow(0, f.offset, f.numel).copy_(theta);
  return applied;
}

void SlowWeightsMethod::hear_partners(const OuterSync& sync) {
  if (!pace_) return;
  for (const auto& [rank, report] : sync.partners_pace) pace_->hear(rank, report, sync.outer_step);
  if (sync.left_behind_by > 0) pace_->fell_behind(sync.left_behind_by);
}

void SlowWeightsMethod::keep_constraint(FlatParams& params) {
  params.project_weights(params.values());
  params.project_weights(phi_);
  params.project_change(momentum_);
}

std::vector<OuterSync> SlowWeightsMethod::finish(FlatParams& params) {
  std::vector<OuterSync> applied;
  if (!config_.overlap) return applied;
  torch::NoGradGuard no_grad;
  for (const auto& f : fragments_) {
    auto& pending = pending_[size_t(f.index)];
    if (!pending.active()) continue;
    auto theta = params.values().narrow(0, f.offset, f.numel);
    const auto r = wait(pending);
    apply_late(f, r.terms, theta);
    keep_constraint(params);
    hear_partners(r.sync);
    start_.narrow(0, f.offset, f.numel).copy_(theta);
    applied.push_back(r.sync);
    pending = Pending{};
  }
  return applied;
}

void SlowWeightsMethod::save(TensorMap& out) const {
  out["outer.phi"] = phi_;
  out["outer.momentum"] = momentum_;
  if (pace_) pace_->save(out);
  if (!config_.overlap) return;
  // An exchange in flight is finished and its result kept, so that a resumed
  // or rejoined replica applies it at the next boundary as this one will.
  out["outer.start"] = start_;
  // What is pending is told by which tensors exist: a Δ mean, maybe a φ mean,
  // and the outer step they belong to.
  for (const auto& f : fragments_) {
    auto& pending = pending_[size_t(f.index)];
    if (!pending.active()) continue;
    const auto r = wait(pending);
    out[fragment_state("outer.pending_delta", f)] = r.terms.mean_delta;
    if (r.terms.mean_phi.defined()) out[fragment_state("outer.pending_phi", f)] = r.terms.mean_phi;
    if (r.terms.kept.defined()) out[fragment_state("outer.pending_kept", f)] = r.terms.kept;
    out[fragment_state("outer.pending_outer_step", f)] = torch::tensor({r.sync.outer_step}, torch::kInt64);
  }
}

void SlowWeightsMethod::load(const TensorMap& in) {
  auto take = [&](const std::string& name, int64_t numel) {
    const auto it = in.find(name);
    TORCH_CHECK(it != in.end(), "checkpoint lacks ", name, " (saved with other overlap or fragments settings?)");
    TORCH_CHECK(it->second.numel() == numel, name, " has ", it->second.numel(), " values, expected ", numel);
    return it->second.reshape({numel});
  };
  phi_.copy_(take("outer.phi", phi_.numel()));  // copy_ converts the dtype
  momentum_.copy_(take("outer.momentum", phi_.numel()));
  if (pace_) pace_->load(in);
  if (!config_.overlap) return;
  start_.copy_(take("outer.start", phi_.numel()));
  for (const auto& f : fragments_) {
    auto& pending = pending_[size_t(f.index)];
    pending = Pending{};
    const auto saved = saved_pending(in, fragment_state("outer.pending_outer_step", f),
                                     fragment_state("outer.pending_phi", f), fragment_state("outer.pending_flags", f));
    if (!saved) continue;
    Result r;
    r.terms.mean_delta = take(fragment_state("outer.pending_delta", f), f.numel).clone();
    if (in.count(fragment_state("outer.pending_kept", f)))
      r.terms.kept = take(fragment_state("outer.pending_kept", f), f.numel).clone();
    if (saved->has_phi) {
      r.terms.mean_phi = take(fragment_state("outer.pending_phi", f), f.numel).clone();
      r.terms.gamma = config_.gamma;  // the pull's weight is the config's
    }
    r.sync.outer_step = saved->outer_step;
    r.sync.fragment = f.index;
    pending.result = r;
  }
}

}  // namespace noloco
