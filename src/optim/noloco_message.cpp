#include "optim/noloco_message.h"

#include <fmt/format.h>

#include "util/splitmix.h"

namespace noloco {

NolocoMessageCodec::NolocoMessageCodec(const OuterConfig& config, const WireCodec& codec, const CosetCodec& coset,
                                       int64_t numel,
                                       const std::function<std::string(const std::string&)>& state_name,
                                       std::shared_ptr<const LowRankCoding> low_rank)
    : codec_(codec), coset_(coset), numel_(numel), rank_(low_rank ? config.message_rank : 0) {
  const bool theta = config.message == NolocoMessage::theta;
  first_ = std::make_unique<ErrorFeedbackChannel>(codec, theta ? Feedback{} : feedback_of(config), numel,
                                                  state_name("residual"), std::move(low_rank));
  if (!theta && config.phi_coding == PhiCoding::coset)
    phi_coset_ = std::make_unique<SlowWeightChannel>(coset, numel, config.stochastic_rounding, state_name("phi_range"));
  if (!theta && config.phi_coding == PhiCoding::codec)
    phi_codec_ = std::make_unique<ErrorFeedbackChannel>(codec, Feedback{}, numel, "");
}

int64_t NolocoMessageCodec::bytes(bool with_phi) const {
  if (!with_phi) return first_->bytes();
  return first_->bytes() + (phi_coset_ ? phi_coset_->bytes() : phi_codec_->bytes());
}

int64_t NolocoMessageCodec::format_id(bool with_phi) const {
  enum Layout : uint64_t { theta = 1, delta = 2, delta_phi_codec = 3, delta_phi_coset = 4 };
  const uint64_t layout = carries_theta() ? theta : !with_phi ? delta : phi_coset_ ? delta_phi_coset : delta_phi_codec;
  const uint64_t phi_format = with_phi && phi_coset_ ? uint64_t(coset_.format_id()) : 0;
  // A fingerprint of the four, positive (the header's -1 means "dropped").
  const uint64_t h =
      splitmix64(splitmix64(splitmix64(splitmix64(uint64_t(codec_.format_id())) + layout) + phi_format) + uint64_t(rank_));
  return int64_t(h >> 1);
}

torch::Tensor NolocoMessageCodec::encode(const NolocoParts& own, bool with_phi, int64_t separation, uint64_t seed,
                                         torch::Tensor* first_leftover) {
  auto payload = torch::empty({bytes(with_phi)}, torch::kUInt8);
  auto* out = payload.data_ptr<uint8_t>();
  *first_leftover = first_->encode(own.first, out, seed);
  out += first_->bytes();
  if (with_phi && phi_coset_) phi_coset_->encode(own.phi, own.first, separation, out, ~seed);
  if (with_phi && phi_codec_) phi_codec_->encode(own.phi, out, ~seed);
  return payload;
}

NolocoParts NolocoMessageCodec::decode(const torch::Tensor& bytes, bool with_phi, const torch::Tensor& own_phi,
                                       int64_t separation, int64_t* failed_blocks) {
  if (bytes.numel() != this->bytes(with_phi))
    throw std::runtime_error(fmt::format("a NoLoCo message of {} bytes, expected {}", bytes.numel(), this->bytes(with_phi)));
  const auto* in = bytes.data_ptr<uint8_t>();
  NolocoParts parts;
  parts.first = first_->decode(in);
  if (!with_phi) return parts;
  in += first_->bytes();
  parts.phi = phi_coset_ ? phi_coset_->decode(in, own_phi, separation, failed_blocks) : phi_codec_->decode(in);
  return parts;
}

int64_t NolocoMessageCodec::phi_blocks() const {
  return phi_coset_ ? int64_t(coset_.blocks(size_t(numel_))) : 0;
}

void NolocoMessageCodec::save(TensorMap& out) const {
  first_->save(out);
  if (phi_coset_) phi_coset_->save(out);
}

void NolocoMessageCodec::load(const TensorMap& in) {
  first_->load(in);
  if (phi_coset_) phi_coset_->load(in);
}

}  // namespace noloco
