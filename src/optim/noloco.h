// NoLoCo (Kolehmainen et al., 2025): every H inner steps each replica
// averages with the members of one small random group (n = 2: one partner)
// by point-to-point messages only, and pulls its slow weights toward the
// group's mean:
//   m_i ← α·m_i + β·mean_G(Δ_j) + γ·(mean_G(φ_j) − φ_i);  φ_i ← φ_i + m_i;  θ_i ← φ_i
// Groups come from a permutation of the live replicas seeded by the outer
// step, identical on every replica without communication. A member that is
// dead or silent is left out and the others average without it.
//
// What travels (noloco_message): "theta" sends θ alone, folding the pull
// into the mean (γ = β): β·mean(Δ) + β·(mean φ − φ_i) = β·(mean θ − φ_i).
// "delta_phi" sends Δ through the wire codec with error feedback, and φ
// either through the codec or coset-coded against the receiver's own φ
// (phi_coding), every phi_every-th outer step. A replica averages its own
// exact values with what it decoded from the others (docs/method.md).
#pragma once
#include <chrono>
#include <deque>
#include <memory>

#include "optim/grouping.h"
#include "optim/slow_weights.h"
#include "optim/noloco_message.h"

namespace noloco {

class NoLoCo final : public SlowWeightsMethod {
 public:
  NoLoCo(const OuterConfig& config, uint64_t seed, ReplicaPeers links, FlatParams& params);
  ~NoLoCo() override { end_exchanges(); }
  void save(TensorMap& out) const override;
  void load(const TensorMap& in) override;

 protected:
  OuterTerms group_means(int64_t exchange_id, const Fragment& fragment, const torch::Tensor& theta,
                         const torch::Tensor& phi, OuterSync& sync) override;

 private:
  // This replica's group for exchange `id`, with the incarnations it is to
  // meet; records the live replicas it was drawn from in `sync`.
  std::vector<Peer> my_group(int64_t id, OuterSync& sync);
  // Alone at exchange `id` for want of the store, which partners read once it answers again.
  std::vector<Peer> alone_without_store(int64_t id, OuterSync& sync) const;
  // Sends `payload` to the group; returns the payloads that arrived, by rank.
  std::map<int, torch::Tensor> send(int64_t id, const std::vector<Peer>& group, const torch::Tensor& payload,
                                    int64_t format, OuterSync& sync);
  // How many of the fragment's φ exchanges before this one have passed since
  // this replica and `partner` last met in one (0: at the last one), counted
  // back at most kSeparationHorizon exchanges over this exchange's roster (a
  // roster that changed since makes it an estimate; a block it misjudges is
  // detected and dropped, not corrupted).
  int64_t phi_separation(const OuterSync& sync, const Fragment& fragment, int partner) const;
  // The arrivals decoded; a malformed one is left out whole, and so is one
  // whose increment is far larger than those this replica met lately, whose
  // sender is told so through the membership. `own`: this replica's Δ (or θ)
  // as its message carries it, and its φ. `separations`: phi_separation of
  // each sender (on φ exchanges).
  std::map<int, NolocoParts> decode(NolocoMessageCodec& message, const std::map<int, torch::Tensor>& arrived,
                                    bool with_phi, const NolocoParts& own, const std::vector<Peer>& group,
                                    const std::map<int, int64_t>& separations, OuterSync& sync);

  // Two exchanges apart a pair is about as far apart as any: counted to 8,
  // pairs one exchange apart failed to decode at step 1560 of the demo run
  // (docs/method.md), the pulls toward other partners bounding the walk.
  static constexpr int64_t kSeparationHorizon = 2;

  uint64_t seed_;
  Transport& transport_;
  Membership* membership_;
  WireCodec codec_;
  CosetCodec coset_;
  std::vector<NolocoMessageCodec> messages_;  // by fragment
  // One outer step's increment norms: this replica's own and the largest of
  // the partners' it took (0: none). By fragment, the last few: the bound on a
  // partner's (noloco.cpp); saved with the outer state, so a resume is bit-identical.
  struct IncrementsMet {
    double own = 0, taken = 0;
  };
  static std::string increments_key(size_t fragment);
  std::vector<std::deque<IncrementsMet>> increments_;
  // partner_wait: when each fragment's last exchange ended (the first: when
  // training began), so that the wait is a share of the period just trained.
  std::vector<std::chrono::steady_clock::time_point> period_began_;
  std::chrono::milliseconds partner_wait(int fragment) const;
};

}  // namespace noloco
