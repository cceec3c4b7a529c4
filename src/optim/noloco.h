// NoLoCo (Kolehmainen et al., 2025): every H inner steps each replica
// averages with the members of one small random group (n = 2: one partner)
// by point-to-point messages only, and pulls its slow weights toward the
// group's mean:
//   m_i ← α·m_i + β·mean_G(Δ_j) + γ·(mean_G(φ_j) − φ_i);  φ_i ← φ_i + m_i;  θ_i ← φ_i
// Groups come from a permutation of the live replicas seeded by the outer
// step, identical on every replica without communication. A member that is
// dead or silent is left out and the others average without it.
#pragma once
#include "optim/grouping.h"
#include "optim/slow_weights.h"

namespace noloco {

class NoLoCo final : public SlowWeightsMethod {
 public:
  NoLoCo(const OuterConfig& config, uint64_t seed, OuterLinks links, FlatParams& params);

 protected:
  OuterTerms exchange(int64_t outer_step, const torch::Tensor& theta, const torch::Tensor& phi,
                      OuterSync& sync) override;

 private:
  // This replica's group at `outer_step`, with the incarnations it is to meet.
  std::vector<Peer> my_group(int64_t outer_step);
  // The fp32 mean over this replica and the peers whose payload arrived, in
  // rank order so that every member computes the same bits.
  torch::Tensor group_mean(int64_t outer_step, const std::vector<Peer>& group, const torch::Tensor& payload,
                           OuterSync& sync);

  uint64_t seed_;
  Transport& transport_;
  Membership* membership_;
};

}  // namespace noloco
