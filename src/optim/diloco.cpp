#include "optim/diloco.h"

#include <fmt/format.h>

#include "util/splitmix.h"

namespace noloco {

DiLoCo::DiLoCo(const OuterConfig& config, uint64_t seed, Transport& transport, FlatParams& params)
    : SlowWeightsMethod(config, params), seed_(seed), transport_(transport), codec_(codec_spec(config)) {
  if (codec_.lossless()) return;
  const int64_t world = transport.world();
  for (const auto& f : fragments()) {
    Shards s;
    s.shard = (f.numel + world - 1) / world;
    for (int64_t k = 0; k < world; ++k)
      s.to_owners.push_back(std::make_unique<ErrorFeedbackChannel>(
          codec_, config.error_feedback, s.shard, fragment_state(fmt::format("residual_shard{}", k), f)));
    s.owned_mean = std::make_unique<ErrorFeedbackChannel>(codec_, config.error_feedback, s.shard,
                                                          fragment_state("residual_mean", f));
    shards_.push_back(std::move(s));
  }
}

void DiLoCo::save(TensorMap& out) const {
  SlowWeightsMethod::save(out);  // first: it waits for an exchange in flight, which uses the channels
  for (const auto& s : shards_) {
    for (const auto& c : s.to_owners) c->save(out);
    s.owned_mean->save(out);
  }
}

void DiLoCo::load(const TensorMap& in) {
  SlowWeightsMethod::load(in);
  for (const auto& s : shards_) {
    for (const auto& c : s.to_owners) c->load(in);
    s.owned_mean->load(in);
  }
}

torch::Tensor DiLoCo::compressed_mean(int64_t exchange_id, Shards& shards, const torch::Tensor& delta) {
  const int world = transport_.world(), me = transport_.rank();
  const int64_t n = delta.numel(), shard = shards.shard, chunk = shards.to_owners[0]->bytes();
  auto padded = torch::zeros({shard * world}, torch::kFloat32);
  padded.narrow(0, 0, n).copy_(delta.reshape({-1}));
  const uint64_t seed = splitmix64(seed_ ^ splitmix64(uint64_t(exchange_id) * 1000003u + uint64_t(me)));
  auto outgoing = torch::empty({chunk * world}, torch::kUInt8);
  for (int s = 0; s < world; ++s)
    shards.to_owners[size_t(s)]->encode(padded.narrow(0, s * shard, shard),
                                        outgoing.data_ptr<uint8_t>() + s * chunk, seed + uint64_t(s));
  // Every replica's version of the shard this replica owns, averaged in rank order.
  const auto incoming = transport_.all_to_all(outgoing);
  auto mean = torch::zeros({shard}, torch::kFloat32);
  for (int r = 0; r < world; ++r)
    mean.add_(r == me ? padded.narrow(0, me * shard, shard)
                      : shards.to_owners[0]->decode(incoming[size_t(r)].data_ptr<uint8_t>()));
  mean.div_(double(world));
  auto owned = torch::empty({chunk}, torch::kUInt8);
  shards.owned_mean->encode(mean, owned.data_ptr<uint8_t>(), ~seed);
  // Everyone decodes the same bytes: the mean is identical on every replica.
  const auto gathered = transport_.all_gather(owned);
  auto out = torch::empty({shard * world}, torch::kFloat32);
  for (int s = 0; s < world; ++s)
    out.narrow(0, s * shard, shard).copy_(shards.owned_mean->decode(gathered[size_t(s)].data_ptr<uint8_t>()));
  return out.narrow(0, 0, n).to(delta.device());
}

OuterTerms DiLoCo::group_means(int64_t exchange_id, const Fragment& fragment, const torch::Tensor& theta,
                               const torch::Tensor& phi, OuterSync& sync) {
  auto delta = theta - phi;
  const auto sent_before = transport_.stats().bytes_sent;
  if (codec_.lossless()) {
    transport_.all_reduce_mean(delta);
  } else {
    delta = compressed_mean(exchange_id, shards_[size_t(fragment.index)], delta);
  }
  sync.bytes = transport_.stats().bytes_sent - sent_before;
  for (int r = 0; r < transport_.world(); ++r) sync.group.push_back(r);
  sync.members = sync.arrived = sync.group;
  return {delta, {}, 0};
}

}  // namespace noloco
