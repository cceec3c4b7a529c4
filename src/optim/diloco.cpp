#include "optim/diloco.h"

#include <fmt/format.h>

#include "util/splitmix.h"

namespace noloco {

DiLoCo::DiLoCo(const OuterConfig& config, uint64_t seed, Transport& transport, FlatParams& params)
    : SlowWeightsMethod(config, params, transport.rank()), seed_(seed), transport_(transport), codec_(codec_spec(config)) {
  if (codec_.lossless() && config.message_rank == 0) return;
  const int64_t world = transport.world();
  const Feedback feedback = feedback_of(config);  // residual=weights only with all_gather (validated)
  for (const auto& f : fragments()) {
    Channels c;
    if (config.diloco_mean == DilocoMean::all_gather) {
      c.whole = std::make_unique<ErrorFeedbackChannel>(codec_, feedback, f.numel, fragment_state("residual", f),
                                                       low_rank_coding(params, f.offset, f.numel, config.message_rank));
      channels_.push_back(std::move(c));
      continue;
    }
    c.shard = (f.numel + world - 1) / world;
    for (int64_t k = 0; k < world; ++k)
      c.to_owners.push_back(std::make_unique<ErrorFeedbackChannel>(
          codec_, feedback, c.shard, fragment_state(fmt::format("residual_shard{}", k), f)));
    c.owned_mean =
        std::make_unique<ErrorFeedbackChannel>(codec_, feedback, c.shard, fragment_state("residual_mean", f));
    channels_.push_back(std::move(c));
  }
}

void DiLoCo::save(TensorMap& out) const {
  SlowWeightsMethod::save(out);  // first: it waits for an exchange in flight, which uses the channels
  for (const auto& c : channels_) c.each([&](const ErrorFeedbackChannel& channel) { channel.save(out); });
}

void DiLoCo::load(const TensorMap& in) {
  SlowWeightsMethod::load(in);
  for (auto& c : channels_) c.each([&](ErrorFeedbackChannel& channel) { channel.load(in); });
}

uint64_t DiLoCo::exchange_seed(int64_t exchange_id) const {
  return splitmix64(seed_ ^ splitmix64(uint64_t(exchange_id) * 1000003u + uint64_t(transport_.rank())));
}

torch::Tensor DiLoCo::scattered_mean(int64_t exchange_id, Channels& channels, const torch::Tensor& delta) {
  const int world = transport_.world(), me = transport_.rank();
  const int64_t n = delta.numel(), shard = channels.shard, chunk = channels.to_owners[0]->bytes();
  auto padded = torch::zeros({shard * world}, torch::kFloat32);
  padded.narrow(0, 0, n).copy_(delta.reshape({-1}));
  const uint64_t seed = exchange_seed(exchange_id);
  auto outgoing = torch::empty({chunk * world}, torch::kUInt8);
  for (int s = 0; s < world; ++s)
    channels.to_owners[size_t(s)]->encode(padded.narrow(0, s * shard, shard),
                                          outgoing.data_ptr<uint8_t>() + s * chunk, seed + uint64_t(s));
  // Every replica's version of the shard this replica owns, averaged in rank order.
  const auto incoming = transport_.all_to_all(outgoing);
  auto mean = torch::zeros({shard}, torch::kFloat32);
  for (int r = 0; r < world; ++r)
    mean.add_(r == me ? padded.narrow(0, me * shard, shard)
                      : channels.to_owners[0]->decode(incoming[size_t(r)].data_ptr<uint8_t>()));
  mean.div_(double(world));
  auto owned = torch::empty({chunk}, torch::kUInt8);
  channels.owned_mean->encode(mean, owned.data_ptr<uint8_t>(), ~seed);
  const auto gathered = transport_.all_gather(owned);
  auto out = torch::empty({shard * world}, torch::kFloat32);
  for (int s = 0; s < world; ++s)
    out.narrow(0, s * shard, shard).copy_(channels.owned_mean->decode(gathered[size_t(s)].data_ptr<uint8_t>()));
  return out.narrow(0, 0, n).to(delta.device());
}

torch::Tensor DiLoCo::gathered_mean(int64_t exchange_id, Channels& channels, const torch::Tensor& delta,
                                    torch::Tensor* kept) {
  auto own = torch::empty({channels.whole->bytes()}, torch::kUInt8);
  const auto leftover = channels.whole->encode(delta, own.data_ptr<uint8_t>(), exchange_seed(exchange_id));
  // This replica's part decoded from its own bytes, like everyone else's.
  const auto gathered = transport_.all_gather(own);
  std::vector<torch::Tensor> sent;
  for (const auto& bytes : gathered) sent.push_back(channels.whole->decode(bytes.data_ptr<uint8_t>()));
  if (leftover.defined()) *kept = leftover * config_.error_feedback_decay;
  torch::Tensor mean;
  if (kept->defined() && config_.topk > 0) {
    // residual=weights under top-k: each replica stands its own in for what
    // the others did not send, so their slow weights part (docs/method.md).
    mean = mean_standing_in_for_unsent(sent, size_t(transport_.rank()), cpu_fp32(delta),
                                       std::vector<double>(sent.size(), 1.0), *kept);
  } else {
    mean = torch::zeros({delta.numel()}, torch::kFloat32);
    for (const auto& values : sent) mean.add_(values);
    mean.div_(double(sent.size()));
  }
  if (kept->defined()) *kept = kept->to(delta.device());
  return mean.to(delta.device());
}

double DiLoCo::share_paces(OuterSync& sync) {
  const auto own = sync.pace->to_bytes();
  const auto gathered =
      transport_.all_gather(torch::tensor(std::vector<int64_t>(own.begin(), own.end())).to(torch::kUInt8));
  double total = 0;
  for (int r = 0; r < transport_.world(); ++r) {
    // A malformed report stops the run, as a malformed mean would.
    const auto report = PaceReport::from_bytes(gathered[size_t(r)].data_ptr<uint8_t>(), gathered[size_t(r)].numel());
    total += double(report.steps);
    if (r != transport_.rank()) sync.partners_pace[r] = report;
  }
  return double(transport_.world()) * double(sync.pace->steps) / total;
}

OuterTerms DiLoCo::group_means(int64_t exchange_id, const Fragment& fragment, const torch::Tensor& theta,
                               const torch::Tensor& phi, OuterSync& sync) {
  const auto sent_before = transport_.stats().bytes_sent;
  // pace=speed: the plain mean of N·w_r/Σw·Δ_r is the steps-weighted mean of the Δ_r.
  const double weight = sync.pace ? share_paces(sync) : 1.0;
  auto delta = weight == 1.0 ? theta - phi : (theta - phi) * weight;
  torch::Tensor kept;
  if (channels_.empty()) {  // fp32, whole
    transport_.all_reduce_mean(delta);
  } else {
    auto& channels = channels_[size_t(fragment.index)];
    delta = channels.whole ? gathered_mean(exchange_id, channels, delta, &kept)
                           : scattered_mean(exchange_id, channels, delta);
  }
  sync.bytes = transport_.stats().bytes_sent - sent_before;
  for (int r = 0; r < transport_.world(); ++r) sync.group.push_back(r);
  sync.members = sync.arrived = sync.group;
  sync.values_received = (transport_.world() - 1) * fragment.numel;  // a malformed one stops the run: none dropped
  return {delta, {}, 0, kept};
}

}  // namespace noloco
