// NoLoCo's outer-step message for one fragment of the weights: its layout,
// its format id, and the stateful channels that turn a replica's values into
// its bytes and a peer's bytes back into values (docs/method.md).
//
// Layout: the first part, then (on outer steps that carry it) φ.
//   noloco_message=theta      first = θ through the wire codec; no φ.
//   noloco_message=delta_phi  first = Δ = θ − φ through the codec, with error
//                             feedback; φ through the codec (phi_coding=codec)
//                             or coset-coded against the receiver's own φ
//                             (phi_coding=coset).
#pragma once
#include <cstdint>
#include <memory>
#include <string>

#include <torch/torch.h>

#include "config/train_config.h"
#include "optim/channels.h"

namespace noloco {

// A replica's values in a message: `first` is θ or Δ; `phi` is undefined
// when the message does not carry φ. fp32, CPU.
struct NolocoParts {
  torch::Tensor first, phi;
};

class NolocoMessageCodec {
 public:
  // `state_name(name)`: the name of this fragment's channel state `name`;
  // `low_rank`: how Δ's matrices travel as factors (message_rank > 0), or null.
  NolocoMessageCodec(const OuterConfig& config, const WireCodec& codec, const CosetCodec& coset, int64_t numel,
                     const std::function<std::string(const std::string&)>& state_name,
                     std::shared_ptr<const LowRankCoding> low_rank);
  bool carries_theta() const { return phi_codec_ == nullptr && phi_coset_ == nullptr; }
  int64_t bytes(bool with_phi) const;
  // Differs between any two layouts (codec, θ or Δ, how φ travels): a
  // receiver expecting another rejects the message by its header.
  int64_t format_id(bool with_phi) const;
  // The message's bytes; under residual=weights `first_leftover` receives
  // what it left out of own.first (unweighted), else an undefined tensor.
  // `separation`: the most φ exchanges since this replica last pulled toward
  // any of the receivers (SlowWeightChannel).
  torch::Tensor encode(const NolocoParts& own, bool with_phi, int64_t separation, uint64_t seed,
                       torch::Tensor* first_leftover);
  // A peer's message; φ decodes against this replica's `own_phi`, and the
  // blocks that fell outside their grid are added to `failed_blocks`.
  // `separation` as for encode, between this replica and the sender.
  // Throws std::runtime_error if malformed.
  NolocoParts decode(const torch::Tensor& bytes, bool with_phi, const torch::Tensor& own_phi, int64_t separation,
                     int64_t* failed_blocks);
  // Values a message carries: Δ or θ, and φ on outer steps that send it.
  int64_t values(bool with_phi) const { return with_phi ? 2 * numel_ : numel_; }
  // The blocks φ is coset-coded in (0 when it is not).
  int64_t phi_blocks() const;
  void save(TensorMap& out) const;
  void load(const TensorMap& in);

 private:
  const WireCodec& codec_;
  const CosetCodec& coset_;
  int64_t numel_;
  int64_t rank_;  // of Δ's factors; 0: Δ travels whole
  std::unique_ptr<ErrorFeedbackChannel> first_;      // θ, or Δ with error feedback
  std::unique_ptr<ErrorFeedbackChannel> phi_codec_;  // φ through the codec
  std::unique_ptr<SlowWeightChannel> phi_coset_;     // φ coset-coded
};

}  // namespace noloco
