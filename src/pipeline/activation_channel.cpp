#include "pipeline/activation_channel.h"

#include <spdlog/spdlog.h>

#include "util/splitmix.h"

namespace noloco {

namespace {

CodecSpec codec_spec(CodecSpec::Type type, int64_t block, bool stochastic, bool rotate) {
  CodecSpec s;
  s.type = type;
  s.block = block;
  s.stochastic = stochastic;
  s.rotate = rotate && integer_code(s.type);
  return s;
}

// Stochastic rounding's seed: the same on a re-run, different per message.
uint64_t message_seed(const ActivationHeader& h) {
  return splitmix64(splitmix64(splitmix64(uint64_t(h.step) * 31 + uint64_t(h.kind)) + uint64_t(h.micro)) +
                    uint64_t(h.boundary) * 1000003u + uint64_t(h.origin));
}

torch::Tensor encoded(const WireCodec& codec, const torch::Tensor& values, uint64_t seed) {
  const auto x = values.detach().to(torch::kCPU, torch::kFloat32).contiguous();
  auto out = torch::empty({int64_t(codec.encoded_bytes(size_t(x.numel())))}, torch::kUInt8);
  codec.encode(x.data_ptr<float>(), size_t(x.numel()), out.data_ptr<uint8_t>(), seed);
  return out;
}

}  // namespace

ActivationCodecs activation_codecs(const TrainConfig& config) {
  const auto& p = config.pipeline;
  return {codec_spec(p.activation_codec, config.outer.quant_block, false, p.activation_rotation),
          codec_spec(p.activation_grad_codec.value_or(p.activation_codec), config.outer.quant_block, true,
                     p.activation_rotation)};
}

ActivationChannel::ActivationChannel(ActivationLink& link, const ActivationCodecs& codecs,
                                     std::shared_ptr<const ResidualSubspace> subspace)
    : link_(link), activation_codec_(codecs.activations), gradient_codec_(codecs.gradients),
      subspace_(std::move(subspace)) {}

const WireCodec* ActivationChannel::codec_for(MessageKind kind) const {
  const WireCodec* codec = kind == MessageKind::activations ? &activation_codec_
                           : kind == MessageKind::gradients ? &gradient_codec_
                                                            : nullptr;
  return codec && !codec->lossless() ? codec : nullptr;
}

int64_t ActivationChannel::format_for(MessageKind kind) const {
  const WireCodec* codec = codec_for(kind);
  int64_t format = codec ? codec->format_id() : 0;
  // Codec ids stay below bit 44 (wire/codec.cpp); a subspace takes the bits above.
  if (subspace_) format |= (int64_t(1) << 61) | (subspace_->k() << 44);
  return format;
}

void ActivationChannel::send(int peer, const ActivationHeader& header, const std::vector<torch::Tensor>& tensors) {
  const WireCodec* codec = codec_for(header.kind);
  if (!training(header.kind) || tensors.empty() || (!codec && !subspace_)) return link_.send(peer, header, tensors);
  auto payload = tensors;
  if (subspace_) {
    torch::NoGradGuard no_grad;
    payload[0] = subspace_->coordinates(tensors[0].detach().to(torch::kFloat32));
  }
  if (codec) payload[0] = encoded(*codec, payload[0], message_seed(header));
  link_.send(peer, header, payload, format_for(header.kind));
}

bool ActivationChannel::recv(int peer, const ActivationHeader& expected, std::vector<torch::Tensor>& tensors,
                             const torch::Tensor& ids) {
  const WireCodec* codec = codec_for(expected.kind);
  if (!training(expected.kind) || tensors.empty() || (!codec && !subspace_))
    return link_.recv(peer, expected, tensors);
  auto& target = tensors[0];
  TORCH_CHECK(target.scalar_type() == torch::kFloat32 && target.is_contiguous(),
              "coded pipeline values are received into contiguous fp32 buffers");
  // What travels: the values themselves, or their subspace coordinates.
  auto values = target;
  if (subspace_) {
    auto shape = target.sizes().vec();
    shape.back() = subspace_->k();
    values = torch::empty(shape, torch::kFloat32);
  }
  auto wire = tensors;
  wire[0] = codec ? torch::empty({int64_t(codec->encoded_bytes(size_t(values.numel())))}, torch::kUInt8) : values;
  if (!link_.recv(peer, expected, wire, format_for(expected.kind))) return false;
  try {
    if (codec)
      codec->decode(wire[0].data_ptr<uint8_t>(), size_t(wire[0].numel()), size_t(values.numel()),
                    values.data_ptr<float>());
    if (subspace_) {
      TORCH_CHECK(expected.kind != MessageKind::activations || ids.defined(),
                  "subspace activations are rebuilt from the micro-batch's token ids");
      if (!torch::isfinite(values).all().item<bool>())
        throw std::runtime_error("subspace coordinates that are not finite");
      torch::NoGradGuard no_grad;
      target = expected.kind == MessageKind::activations ? subspace_->residual(values, ids)
                                                         : subspace_->span_vector(values);
    }
  } catch (const std::runtime_error& e) {
    spdlog::error("refused a pipeline message from worker {} (step {}, micro-batch {}): {}; dropped", peer,
                  expected.step, expected.micro, e.what());
    link_.note_refused();
    return false;
  }
  return true;
}

}  // namespace noloco
