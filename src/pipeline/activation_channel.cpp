#include "pipeline/activation_channel.h"

#include <algorithm>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "util/splitmix.h"

namespace noloco {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

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

ActivationChannel::ActivationChannel(PipelineRoster& rosters, PeerLink& link, int stages,
                                     const ActivationCodecs& codecs, std::shared_ptr<const ResidualSubspace> subspace)
    : rosters_(rosters), link_(link), stages_(stages), activation_codec_(codecs.activations),
      gradient_codec_(codecs.gradients), subspace_(std::move(subspace)) {}

const Roster& ActivationChannel::enter(const std::string& name) {
  roster_ = rosters_.snapshot(name);
  std::vector<Peer> listed;  // global ranks, in rank order
  for (int s = 0; s < stages_; ++s)
    for (const auto& p : roster_->stages[size_t(s)]) listed.push_back({p.rank * stages_ + s, p.incarnation});
  std::sort(listed.begin(), listed.end(), [](const Peer& a, const Peer& b) { return a.rank < b.rank; });
  listed_ = std::find(listed.begin(), listed.end(), link_.self()) != listed.end();
  if (!listed_) {
    if (was_listed_ && !leaving_)
      throw std::runtime_error(fmt::format(
          "worker {} was given up by its pipeline neighbours (roster {} leaves it out); it stops so that it can be "
          "restarted",
          link_.self().rank, name));
    return *roster_;
  }
  was_listed_ = true;
  // Everyone listed reaches this roster (finishing the step before needs
  // nothing of the step after), so forming the group here cannot deadlock.
  link_.form(name, listed);
  return *roster_;
}

MessageHeader ActivationChannel::header_of(const ActivationHeader& h, const std::vector<torch::Tensor>& tensors) const {
  MessageHeader m;
  m.run = link_.run_id();
  m.kind = int64_t(h.kind);
  m.exchange = h.step;
  m.micro = h.micro;
  m.boundary = h.boundary;
  m.origin = h.origin;
  for (const auto& t : tensors) m.bytes += int64_t(t.numel()) * int64_t(t.element_size());
  return m;
}

const WireCodec* ActivationChannel::codec_for(MessageKind kind) const {
  const WireCodec* codec = kind == MessageKind::activations ? &activation_codec_
                           : kind == MessageKind::gradients ? &gradient_codec_
                                                            : nullptr;
  return codec && !codec->lossless() ? codec : nullptr;
}

int64_t ActivationChannel::format_for(MessageKind kind) const {
  if (!training(kind)) return 0;
  const WireCodec* codec = codec_for(kind);
  int64_t format = codec ? codec->format_id() : 0;
  // Codec ids stay below bit 44 (wire/codec.cpp); a subspace takes the bits above.
  if (subspace_) format |= (int64_t(1) << 61) | (subspace_->k() << 44);
  return format;
}

std::vector<torch::Tensor> ActivationChannel::wire_payload(const ActivationHeader& header,
                                                           const std::vector<torch::Tensor>& tensors) const {
  auto payload = tensors;
  const WireCodec* codec = codec_for(header.kind);
  if (training(header.kind) && !payload.empty()) {
    if (subspace_) {
      torch::NoGradGuard no_grad;
      payload[0] = subspace_->coordinates(tensors[0].detach().to(torch::kFloat32));
    }
    if (codec) payload[0] = encoded(*codec, payload[0], message_seed(header));
  }
  for (auto& t : payload) t = t.detach().to(torch::kCPU).contiguous();
  return payload;
}

void ActivationChannel::send(int peer, const ActivationHeader& header, const std::vector<torch::Tensor>& tensors) {
  auto payload = wire_payload(header, tensors);
  auto announced = header_of(header, payload);
  announced.format = format_for(header.kind);
  const bool evaluation = header.kind == MessageKind::evaluation;
  if (!link_.send(peer, announced, std::move(payload))) return;
  (evaluation ? stats_.evaluation_bytes_sent : stats_.bytes_sent) += uint64_t(announced.bytes);

  if (!evaluation) stats_.messages += 1;
}

void ActivationChannel::send_dropped(int peer, const ActivationHeader& header) {
  if (link_.send(peer, dropped_notice(header_of(header, {})), {}) && header.kind != MessageKind::evaluation)
    stats_.messages += 1;
}

bool ActivationChannel::receive_wire(int peer, const ActivationHeader& expected, std::vector<torch::Tensor>& wire,
                                     int64_t format) {
  const bool evaluation = expected.kind == MessageKind::evaluation;
  const auto start = Clock::now();
  auto announced = header_of(expected, wire);
  announced.format = format;
  std::string problem;
  const auto delivery = link_.receive(peer, announced, wire, problem);
  if (delivery == Delivery::rejected)
    throw std::runtime_error(fmt::format("rejected a pipeline message from worker {}: {}", peer, problem));
  if (delivery == Delivery::peer_lost || delivery == Delivery::unauthentic)
    link_.lose(peer, fmt::format("no {} (step {}, micro-batch {}): {}", message_kind_name(int64_t(expected.kind)),
                                 expected.step, expected.micro, problem));
  if (evaluation) return delivery == Delivery::received;
  stats_.idle_seconds += seconds_since(start);
  if (delivery != Delivery::received) {
    stats_.micro_batches_dropped += 1;
    return false;
  }
  for (const auto& t : wire) stats_.bytes_received += t.nbytes();  // what crossed the wire, decodable or not
  return true;
}

bool ActivationChannel::recv(int peer, const ActivationHeader& expected, std::vector<torch::Tensor>& tensors,
                             const torch::Tensor& ids) {
  const WireCodec* codec = codec_for(expected.kind);
  if (!training(expected.kind) || tensors.empty() || (!codec && !subspace_))
    return receive_wire(peer, expected, tensors, format_for(expected.kind));
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
  // The other tensors (labels) are received in place: `wire` shares them.
  if (!receive_wire(peer, expected, wire, format_for(expected.kind))) return false;
  return decode(peer, expected, wire[0], values, target, ids);
}

bool ActivationChannel::decode(int peer, const ActivationHeader& expected, const torch::Tensor& wire,
                               torch::Tensor& values, torch::Tensor& target, const torch::Tensor& ids) {
  const WireCodec* codec = codec_for(expected.kind);
  try {
    if (codec)
      codec->decode(wire.data_ptr<uint8_t>(), size_t(wire.numel()), size_t(values.numel()), values.data_ptr<float>());
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
    stats_.micro_batches_dropped += 1;
    return false;
  }
  return true;
}

PipelineStats ActivationChannel::stats() const {
  auto s = stats_;
  s.peers_lost = link_.peers_lost();
  const auto routed = link_.routed();
  s.bytes_relayed = routed.relayed;
  s.bytes_punched = routed.punched;
  return s;
}

}  // namespace noloco
