#include "optim/channels.h"

#include <algorithm>
#include <cmath>

namespace noloco {

torch::Tensor cpu_fp32(const torch::Tensor& t) { return t.detach().to(torch::kCPU, torch::kFloat32).contiguous(); }

torch::Tensor mean_standing_in_for_unsent(const std::vector<torch::Tensor>& sent, size_t own,
                                          const torch::Tensor& own_whole, const std::vector<double>& weights,
                                          torch::Tensor& kept) {
  std::vector<torch::Tensor> carries(sent.size());  // by peer: the values its message carried
  auto carried = torch::zeros(sent[own].sizes(), torch::kBool);
  for (size_t i = 0; i < sent.size(); ++i)
    if (i != own) carried.logical_or_(carries[i] = sent[i] != 0);
  const auto mine = torch::where(carried, own_whole, sent[own]);
  auto sum = torch::zeros(mine.sizes(), torch::kFloat32);
  double total = 0;
  for (size_t i = 0; i < sent.size(); ++i) {
    sum.add_(i == own ? mine : torch::where(carries[i], sent[i], mine), weights[i]);
    total += weights[i];
  }
  kept.masked_fill_(carried, 0.0f);
  return sum.div_(total);
}

namespace {

// max |x| of every block of `block` values (the last one may be short).
torch::Tensor block_peaks(const torch::Tensor& x, int64_t block) {
  const int64_t n = x.numel(), blocks = (n + block - 1) / block;
  auto padded = torch::zeros({blocks * block}, torch::kFloat32);
  padded.narrow(0, 0, n).copy_(x.reshape({-1}));
  return std::get<0>(padded.view({blocks, block}).abs().max(1));
}

void load_state(const TensorMap& in, const std::string& name, torch::Tensor& into) {
  const auto it = in.find(name);
  TORCH_CHECK(it != in.end(), "checkpoint lacks ", name, " (saved with other compression settings?)");
  TORCH_CHECK(it->second.numel() == into.numel(), name, " has ", it->second.numel(), " values, expected ",
              into.numel());
  into.copy_(it->second.reshape(into.sizes()));
}

// How much further apart two replicas' slow weights are expected to be after
// `separation` φ exchanges without a pull between them (SlowWeightChannel).
double drift_factor(int64_t separation) { return std::sqrt(1.0 + double(separation)); }

}  // namespace

CodecSpec codec_spec(const OuterConfig& c) {
  CodecSpec s;
  s.type = c.wire_dtype;
  s.topk = c.topk;
  s.block = c.quant_block;
  s.stochastic = c.stochastic_rounding;
  return s;
}

Feedback feedback_of(const OuterConfig& config) {
  return {config.error_feedback ? config.error_feedback_decay : 0.0, config.residual};
}

ErrorFeedbackChannel::ErrorFeedbackChannel(const WireCodec& codec, Feedback feedback, int64_t numel,
                                           std::string state_name, std::shared_ptr<const LowRankCoding> low_rank)
    : codec_(codec),
      numel_(numel),
      state_name_(std::move(state_name)),
      feedback_(feedback),
      low_rank_(std::move(low_rank)) {
  if (feedback.weight > 0 && feedback.home == ResidualHome::message && !lossless())
    residual_ = torch::zeros({numel}, torch::kFloat32);
}

torch::Tensor ErrorFeedbackChannel::encode(const torch::Tensor& x, uint8_t* out, uint64_t seed) {
  auto send = cpu_fp32(x);
  const double w = feedback_.weight;
  if (residual_.defined()) send = w == 1 ? send + residual_ : send + w * residual_;
  const auto coded = low_rank_ ? low_rank_->factor(send, seed) : send;
  codec_.encode(coded.data_ptr<float>(), size_t(coded_values()), out, seed);
  const bool hand_back = w > 0 && feedback_.home == ResidualHome::weights && !lossless();
  if (!residual_.defined() && !hand_back) return {};
  auto leftover = send - decode(out);
  if (hand_back) return leftover;
  residual_ = std::move(leftover);
  return {};
}

torch::Tensor ErrorFeedbackChannel::decode(const uint8_t* in) const {
  auto out = torch::empty({coded_values()}, torch::kFloat32);
  codec_.decode(in, size_t(bytes()), size_t(coded_values()), out.data_ptr<float>());
  return low_rank_ ? low_rank_->expand(out) : out;
}

void ErrorFeedbackChannel::save(TensorMap& out) const {
  if (residual_.defined()) out["outer." + state_name_] = residual_;
}

void ErrorFeedbackChannel::load(const TensorMap& in) {
  if (residual_.defined()) load_state(in, "outer." + state_name_, residual_);
}

SlowWeightChannel::SlowWeightChannel(const CosetCodec& codec, int64_t numel, bool stochastic, std::string state_name)
    : codec_(codec),
      numel_(numel),
      stochastic_(stochastic),
      state_name_(std::move(state_name)),
      range_(torch::zeros({int64_t(codec.blocks(size_t(numel)))}, torch::kFloat32)) {}

void SlowWeightChannel::encode(const torch::Tensor& phi, const torch::Tensor& delta, int64_t separation,
                               uint8_t* out, uint64_t seed) const {
  // A grid just fine enough for three times the disagreement expected at
  // this separation, and never finer than six times this replica's own
  // progress in the block needs: early in a run the slow weights drift apart
  // faster than the last exchange showed (measured, docs/method.md: with a
  // floor of once the progress, 40-75% of the blocks of the second φ
  // exchange failed; with six times, none).
  const auto progress = block_peaks(cpu_fp32(delta), int64_t(codec_.block()));
  const auto expected = range_ * drift_factor(separation);
  const auto steps = (torch::maximum(expected * 3, progress * 6) / double(codec_.range_in_steps())).contiguous();
  const auto x = cpu_fp32(phi);
  codec_.encode(x.data_ptr<float>(), size_t(numel_), steps.data_ptr<float>(), out, stochastic_, seed);
}

torch::Tensor SlowWeightChannel::decode(const uint8_t* in, const torch::Tensor& own_phi, int64_t separation,
                                        int64_t* failed) {
  const auto own = cpu_fp32(own_phi);
  auto out = torch::empty({numel_}, torch::kFloat32);
  std::vector<uint8_t> failed_blocks;
  *failed += int64_t(codec_.decode(in, size_t(bytes()), size_t(numel_), own.data_ptr<float>(),
                                   out.data_ptr<float>(), &failed_blocks));
  const auto seen = block_peaks(out - own, int64_t(codec_.block()));
  const float per_drift = float(1.0 / drift_factor(separation));
  auto* range = range_.data_ptr<float>();
  const auto* observed = seen.data_ptr<float>();
  for (size_t b = 0; b < failed_blocks.size(); ++b) {
    const float step = codec_.step_of(in, b);
    if (failed_blocks[b]) {
      // The partner's range was too narrow for our disagreement: ours is at least twice that.
      range[b] = std::max(range[b], 2.0f * step * float(codec_.range_in_steps()) * per_drift);
    } else {
      // What we decoded is off by up to half a step: without that, the
      // grid would shrink with its own rounding while replicas agree.
      range[b] = std::max((observed[b] - 0.5f * step) * per_drift, 0.5f * range[b]);
    }
  }
  return out;
}

void SlowWeightChannel::save(TensorMap& out) const { out["outer." + state_name_] = range_; }

void SlowWeightChannel::load(const TensorMap& in) { load_state(in, "outer." + state_name_, range_); }

}  // namespace noloco
