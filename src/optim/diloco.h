// DiLoCo (Douillard et al., 2023): every H inner steps all replicas average
// their progress Δ = θ − φ and take the outer momentum step on the mean; φ
// stays identical on every replica.
//
// With fp32 the mean is one all-reduce. With a lossy codec, every replica's
// Δ goes through an error-feedback channel, and the mean is formed one of
// two ways (diloco_mean):
//  - reduce_scatter: Δ cut into N shards, each compressed and sent to its
//    owner in one all-to-all; each owner averages its shard and compresses the
//    mean (with a residual of its own) for one all-gather. 2(N−1)/N compressed
//    payloads a replica, as a ring all-reduce, but every value rounded twice.
//  - all_gather: each replica's whole Δ compressed once and gathered by all
//    (N−1 payloads a replica): the choice for sparse and low-rank messages
//    (message_rank), whose mean is denser than any of them and would not
//    survive a second compression.
// What a lossy message left out either waits in an error-feedback buffer for
// the next message (residual=message) or, with all_gather, stays in the
// replica's own weights (residual=weights): θ ← φ + w·leftover, so a sparse
// message does not reset away the local progress it could not carry; the
// replicas' θ then differ by their leftovers while φ stays identical.
// Either way every replica decodes the same bytes into the same mean.
// pace=speed: the replicas first gather their PaceReports (40 bytes each)
// and each scales its Δ by N·w_r/Σw, w_r its steps, so the mean is weighted.
#pragma once
#include <memory>
#include <vector>

#include "optim/channels.h"
#include "optim/slow_weights.h"

namespace noloco {

class DiLoCo final : public SlowWeightsMethod {
 public:
  DiLoCo(const OuterConfig& config, uint64_t seed, Transport& transport, FlatParams& params);
  ~DiLoCo() override { end_exchanges(); }
  void save(TensorMap& out) const override;
  void load(const TensorMap& in) override;

 protected:
  OuterTerms group_means(int64_t exchange_id, const Fragment& fragment, const torch::Tensor& theta,
                         const torch::Tensor& phi, OuterSync& sync) override;

 private:
  // The channels of one fragment of the weights.
  struct Channels {
    int64_t shard = 0;  // reduce_scatter: values a shard (the last one zero-padded)
    std::vector<std::unique_ptr<ErrorFeedbackChannel>> to_owners;  // reduce_scatter: one per shard
    std::unique_ptr<ErrorFeedbackChannel> owned_mean;             // reduce_scatter: this replica's shard of the mean
    std::unique_ptr<ErrorFeedbackChannel> whole;                  // all_gather: this replica's Δ
    template <class F>
    void each(F f) const {
      for (const auto& c : to_owners) f(*c);
      for (auto* c : {owned_mean.get(), whole.get()})
        if (c) f(*c);
    }
  };
  torch::Tensor scattered_mean(int64_t exchange_id, Channels& channels, const torch::Tensor& delta);
  // With residual=weights, `kept` receives decay·(what this replica's message left out).
  torch::Tensor gathered_mean(int64_t exchange_id, Channels& channels, const torch::Tensor& delta,
                              torch::Tensor* kept);
  // pace=speed: every replica's PaceReport, gathered into sync.partners_pace;
  // returns this replica's Δ factor N·w/Σw (w: its steps).
  double share_paces(OuterSync& sync);
  // Drives stochastic rounding: distinct for every exchange and replica.
  uint64_t exchange_seed(int64_t exchange_id) const;

  uint64_t seed_;
  Transport& transport_;
  WireCodec codec_;
  std::vector<Channels> channels_;  // by fragment
};

}  // namespace noloco
