#include "optim/diloco.h"

#include <fmt/format.h>

#include "util/splitmix.h"

namespace noloco {

DiLoCo::DiLoCo(const OuterConfig& config, uint64_t seed, Transport& transport, FlatParams& params)
    : SlowWeightsMethod(config, params), seed_(seed), transport_(transport), codec_(codec_spec(config)) {
  if (codec_.lossless()) return;
  const int64_t n = params.numel(), world = transport.world();
  shard_ = (n + world - 1) / world;
  for (int64_t s = 0; s < world; ++s)
    to_owners_.push_back(std::make_unique<ErrorFeedbackChannel>(codec_, config.error_feedback, shard_,
                                                                fmt::format("residual_shard{}", s)));
  owned_mean_ = std::make_unique<ErrorFeedbackChannel>(codec_, config.error_feedback, shard_, "residual_mean");
}

void DiLoCo::save(TensorMap& out) const {
  SlowWeightsMethod::save(out);
  for (const auto& c : to_owners_) c->save(out);
  if (owned_mean_) owned_mean_->save(out);
}

void DiLoCo::load(const TensorMap& in) {
  SlowWeightsMethod::load(in);
  for (const auto& c : to_owners_) c->load(in);
  if (owned_mean_) owned_mean_->load(in);
}

torch::Tensor DiLoCo::compressed_mean(int64_t outer_step, const torch::Tensor& delta) {
  const int world = transport_.world(), me = transport_.rank();
  const int64_t n = delta.numel(), chunk = to_owners_[0]->bytes();
  auto padded = torch::zeros({shard_ * world}, torch::kFloat32);
  padded.narrow(0, 0, n).copy_(delta.reshape({-1}));
  const uint64_t seed = splitmix64(seed_ ^ splitmix64(uint64_t(outer_step) * 1000003u + uint64_t(me)));
  auto outgoing = torch::empty({chunk * world}, torch::kUInt8);
  for (int s = 0; s < world; ++s)
    to_owners_[size_t(s)]->encode(padded.narrow(0, s * shard_, shard_), outgoing.data_ptr<uint8_t>() + s * chunk,
                                  seed + uint64_t(s));
  // Every replica's version of the shard this replica owns, averaged in rank order.
  const auto incoming = transport_.all_to_all(outgoing);
  auto mean = torch::zeros({shard_}, torch::kFloat32);
  for (int r = 0; r < world; ++r)
    mean.add_(r == me ? padded.narrow(0, me * shard_, shard_) : to_owners_[0]->decode(incoming[size_t(r)].data_ptr<uint8_t>()));
  mean.div_(double(world));
  auto owned = torch::empty({chunk}, torch::kUInt8);
  owned_mean_->encode(mean, owned.data_ptr<uint8_t>(), ~seed);
  // Everyone decodes the same bytes: the mean is identical on every replica.
  const auto shards = transport_.all_gather(owned);
  auto out = torch::empty({shard_ * world}, torch::kFloat32);
  for (int s = 0; s < world; ++s)
    out.narrow(0, s * shard_, shard_).copy_(owned_mean_->decode(shards[size_t(s)].data_ptr<uint8_t>()));
  return out.narrow(0, 0, n).to(delta.device());
}

OuterTerms DiLoCo::exchange(int64_t outer_step, const torch::Tensor& theta, const torch::Tensor& phi, OuterSync& sync) {
  auto delta = theta - phi;
  const auto sent_before = transport_.stats().bytes_sent;
  if (codec_.lossless()) {
    transport_.all_reduce_mean(delta);
  } else {
    delta = compressed_mean(outer_step, delta);
  }
  sync.bytes = transport_.stats().bytes_sent - sent_before;
  for (int r = 0; r < transport_.world(); ++r) sync.group.push_back(r);
  sync.arrived = sync.group;
  return {delta, {}, 0};
}

}  // namespace noloco
