// The compressed channels an outer method sends through, and the state they
// keep between outer steps (part of the replica's outer state: checkpointed,
// resumed bit for bit, handed over on rejoin).
#pragma once
#include <cstdint>
#include <string>

#include <torch/torch.h>

#include "wire/codec.h"
#include "wire/coset_codec.h"
#include "config/train_config.h"
#include "optim/low_rank.h"
#include "util/tensor_map.h"

namespace noloco {

// The wire codec a config asks for.
CodecSpec codec_spec(const OuterConfig& config);

// What every codec encodes from: a contiguous fp32 copy on the CPU (the
// weights may live on a GPU or train in another precision).
torch::Tensor cpu_fp32(const torch::Tensor& t);

// What becomes of what a message left out: its weight w (0 without error
// feedback, 1 plain, below 1 decaying) and where it goes (residual=message:
// into the next message; residual=weights: back to the caller, who keeps
// w·leftover in the replica's weights).
struct Feedback {
  double weight = 0;
  ResidualHome home = ResidualHome::message;
};
Feedback feedback_of(const OuterConfig& config);

// The mean of a group's top-k messages under residual=weights
// (docs/method.md, "What a top-k message left out"): a value a peer's
// message did not carry is not zero but unknown, and counts as this
// replica's own. Where a peer's message carried a value, this replica's own
// counts whole (`own_whole`, its Δ; nothing of it is kept back, since the
// mean holds it); where none did, as its own message carried it, the rest
// staying in its weights. `sent`: the decoded messages in rank order, this
// replica's at `own`; `weights` by the same index (each replica's steps
// under pace=speed, else 1). Zeroes `kept` where the mean now holds it.
torch::Tensor mean_standing_in_for_unsent(const std::vector<torch::Tensor>& sent, size_t own,
                                          const torch::Tensor& own_whole, const std::vector<double>& weights,
                                          torch::Tensor& kept);

// An increment (the pseudo-gradient Δ) through a wire codec with error
// feedback: what the codec could not carry this time is added to what is
// sent next time, so compression delays information instead of losing it.
// With a LowRankCoding the codec carries the increment's low-rank factors.
// With a weight w < 1 (SparseLoCo), e ← w·e + Δ: the residual is also a
// decaying sum of past increments, which stands in for outer momentum.
class ErrorFeedbackChannel {
 public:
  ErrorFeedbackChannel(const WireCodec& codec, Feedback feedback, int64_t numel, std::string state_name,
                       std::shared_ptr<const LowRankCoding> low_rank = nullptr);
  int64_t bytes() const { return int64_t(codec_.encoded_bytes(size_t(coded_values()))); }
  // Encodes x (plus w·residual under residual=message, which then becomes
  // what was lost) into `out` (bytes() of them). Returns, under
  // residual=weights with a lossy codec, what the message left out of x
  // (unweighted); otherwise an undefined tensor.
  torch::Tensor encode(const torch::Tensor& x, uint8_t* out, uint64_t seed);
  // A peer's message, decoded to fp32. Throws std::runtime_error if malformed.
  torch::Tensor decode(const uint8_t* in) const;
  void save(TensorMap& out) const;
  void load(const TensorMap& in);

 private:
  int64_t coded_values() const { return low_rank_ ? low_rank_->coded_values() : numel_; }
  bool lossless() const { return codec_.lossless() && !low_rank_; }

  const WireCodec& codec_;
  int64_t numel_;
  std::string state_name_;
  Feedback feedback_;
  std::shared_ptr<const LowRankCoding> low_rank_;
  torch::Tensor residual_;  // residual=message only; undefined without error feedback or with a lossless codec
};

// Slow weights φ by coset coding against the receiver's own φ (see
// wire/coset_codec.h). Each replica learns, per block, how far its partners'
// φ have been from its own, and sends with a grid just fine enough for
// three times that, never finer than six times its own progress in the block
// (docs/method.md); a block that did not decode widens its range.
//
// Two replicas that have not pulled toward each other for m φ exchanges
// drift apart like a random walk, by √(1 + m) times a pair that pulled last
// time (`separation` = m, known to both from the seeded pairing, counted to
// a horizon past which the pulls toward others bound it). What is learned is
// therefore the disagreement per unit of √(1 + m): a replica that met the
// same partner twice in a row would otherwise learn a small range and send
// too fine a grid to the next, far one.
class SlowWeightChannel {
 public:
  SlowWeightChannel(const CosetCodec& codec, int64_t numel, bool stochastic, std::string state_name);
  int64_t bytes() const { return int64_t(codec_.encoded_bytes(size_t(numel_))); }
  // `delta` (this replica's progress) sets the finest grid a block may get;
  // `separation` is the largest among the receivers.
  void encode(const torch::Tensor& phi, const torch::Tensor& delta, int64_t separation, uint8_t* out,
              uint64_t seed) const;
  // A peer's φ, decoded against ours; learns the disagreement it shows.
  // Adds the blocks that failed to decode (kept at our own φ) to `failed`.
  torch::Tensor decode(const uint8_t* in, const torch::Tensor& own_phi, int64_t separation, int64_t* failed);
  void save(TensorMap& out) const;
  void load(const TensorMap& in);

 private:
  const CosetCodec& codec_;
  int64_t numel_;
  bool stochastic_;
  std::string state_name_;
  torch::Tensor range_;  // per block: recent largest |φ_partner − φ_own| / √(1 + separation)
};

}  // namespace noloco
