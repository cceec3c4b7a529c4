// DiLoCo (Douillard et al., 2023): every H inner steps all replicas average
// their progress Δ = θ − φ and take the outer momentum step on the mean; φ
// stays identical on every replica.
//
// With fp32 the mean is one all-reduce. With a lossy codec it is a
// compressed all-reduce built from two c10d collectives: every replica's Δ
// (plus its error-feedback residual), cut into N shards and compressed, goes
// to the shards' owners in one all-to-all; each owner averages its shard and
// compresses the mean (with a residual of its own) for one all-gather. That
// sends 2(N−1)/N compressed payloads a replica, as a ring all-reduce would,
// with two roundings instead of N−1, and every replica decodes the same mean.
#pragma once
#include <memory>
#include <vector>

#include "wire/channels.h"
#include "optim/slow_weights.h"

namespace noloco {

class DiLoCo final : public SlowWeightsMethod {
 public:
  DiLoCo(const OuterConfig& config, uint64_t seed, Transport& transport, FlatParams& params);
  void save(TensorMap& out) const override;
  void load(const TensorMap& in) override;

 protected:
  OuterTerms group_means(int64_t exchange_id, const Fragment& fragment, const torch::Tensor& theta,
                         const torch::Tensor& phi, OuterSync& sync) override;

 private:
  // The channels of one fragment of the weights.
  struct Shards {
    int64_t shard = 0;  // values a shard (the last one zero-padded)
    std::vector<std::unique_ptr<ErrorFeedbackChannel>> to_owners;  // one per shard
    std::unique_ptr<ErrorFeedbackChannel> owned_mean;             // this replica's shard of the mean
  };
  torch::Tensor compressed_mean(int64_t exchange_id, Shards& shards, const torch::Tensor& delta);

  uint64_t seed_;
  Transport& transport_;
  WireCodec codec_;
  std::vector<Shards> shards_;  // by fragment
};

}  // namespace noloco
