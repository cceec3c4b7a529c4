#include "optim/noloco.h"

#include <algorithm>

#include "util/log.h"
#include "util/splitmix.h"

namespace noloco {

namespace {

// The mean of this replica's own values and the others' decoded ones, summed
// in rank order from zero.
torch::Tensor rank_ordered_mean(int me, const torch::Tensor& own, const std::map<int, torch::Tensor>& others) {
  std::vector<int> ranks{me};
  for (const auto& [r, t] : others) ranks.push_back(r);
  std::sort(ranks.begin(), ranks.end());
  auto sum = torch::zeros(own.sizes(), torch::kFloat32);
  for (int r : ranks) sum.add_(r == me ? own : others.at(r));
  return sum.div_(double(ranks.size()));
}

}  // namespace

NoLoCo::NoLoCo(const OuterConfig& config, uint64_t seed, OuterLinks links, FlatParams& params)
    : SlowWeightsMethod(config, params),
      seed_(seed),
      transport_(*links.transport),
      membership_(links.membership),
      codec_(codec_spec(config)),
      coset_(int(config.phi_bits), config.quant_block) {
  const bool theta = config.message == NolocoMessage::theta;
  for (const auto& f : fragments()) {
    Channels c;
    c.first = std::make_unique<ErrorFeedbackChannel>(codec_, config.error_feedback && !theta, f.numel,
                                                     fragment_state("residual", f));
    if (!theta && config.phi_coding == PhiCoding::coset)
      c.phi_coset = std::make_unique<SlowWeightChannel>(coset_, f.numel, config.stochastic_rounding,
                                                        fragment_state("phi_range", f));
    if (!theta && config.phi_coding == PhiCoding::codec)
      c.phi_codec = std::make_unique<ErrorFeedbackChannel>(codec_, /*error_feedback=*/false, f.numel, "");
    channels_.push_back(std::move(c));
  }
}

void NoLoCo::save(TensorMap& out) const {
  SlowWeightsMethod::save(out);  // first: it waits for an exchange in flight, which uses the channels
  for (const auto& c : channels_) {
    c.first->save(out);
    if (c.phi_coset) c.phi_coset->save(out);
  }
}

void NoLoCo::load(const TensorMap& in) {
  SlowWeightsMethod::load(in);
  for (const auto& c : channels_) {
    c.first->load(in);
    if (c.phi_coset) c.phi_coset->load(in);
  }
}

std::vector<Peer> NoLoCo::my_group(int64_t id) {
  std::vector<Peer> members;
  if (membership_) {
    members = membership_->snapshot(std::to_string(id));
  } else {
    for (int r = 0; r < transport_.world(); ++r) members.push_back({r, 0});
  }
  std::vector<int> ranks;
  for (const auto& p : members) ranks.push_back(p.rank);
  for (const auto& g : noloco_groups(seed_, id, ranks, int(config_.group_size))) {
    if (std::find(g.begin(), g.end(), transport_.rank()) == g.end()) continue;
    std::vector<Peer> group;
    for (int r : g)
      group.push_back(*std::find_if(members.begin(), members.end(), [&](const Peer& p) { return p.rank == r; }));
    return group;
  }
  // Left out of this snapshot (restarted, or thought dead): alone this time.
  return {membership_ ? membership_->self() : Peer{transport_.rank(), 0}};
}

std::map<int, torch::Tensor> NoLoCo::send(int64_t id, const std::vector<Peer>& group, const torch::Tensor& payload,
                                          int64_t format, OuterSync& sync) {
  for (const auto& p : group) sync.group.push_back(p.rank);
  ExchangeRequest request;
  request.id = id;
  request.group = group;
  request.header.kind = int64_t(MessageKind::exchange);
  request.header.exchange = id;
  request.header.bytes = payload.numel();
  request.header.format = format;
  request.payload = payload;
  if (membership_) request.give_up = [this](int r) { return membership_->given_up(r); };
  const auto sent_before = transport_.stats().bytes_sent;
  auto result = group.size() > 1 ? transport_.exchange(request) : ExchangeResult{};
  sync.bytes = transport_.stats().bytes_sent - sent_before;
  if (membership_)
    for (int r : result.lost) membership_->declare_dead(r);  // later snapshots leave it out
  return std::move(result.received);
}

OuterTerms NoLoCo::exchange(int64_t id, const Fragment& fragment, const torch::Tensor& theta, const torch::Tensor& phi,
                            OuterSync& sync) {
  const auto group = my_group(id);
  auto& c = channels_[size_t(fragment.index)];
  const bool theta_message = config_.message == NolocoMessage::theta;
  const bool with_phi = !theta_message && (sync.outer_step + 1) % config_.phi_every == 0;
  const auto own = cpu_fp32(theta_message ? theta : theta - phi), own_phi = cpu_fp32(phi);
  const int64_t first_bytes = c.first->bytes();
  const int64_t phi_bytes = !with_phi ? 0 : c.phi_coset ? c.phi_coset->bytes() : c.phi_codec->bytes();
  auto payload = torch::empty({first_bytes + phi_bytes}, torch::kUInt8);
  auto* out = payload.data_ptr<uint8_t>();
  const uint64_t seed = splitmix64(seed_ ^ splitmix64(uint64_t(id) * 1000003u + uint64_t(transport_.rank())));
  c.first->encode(own, out, seed);
  if (with_phi && c.phi_coset) c.phi_coset->encode(own_phi, own, out + first_bytes, ~seed);
  if (with_phi && c.phi_codec) c.phi_codec->encode(own_phi, out + first_bytes, ~seed);
  const int64_t format = codec_.format_id() ^ (theta_message ? int64_t(1) << 40 : 0) ^
                         (!with_phi ? 0 : c.phi_coset ? coset_.format_id() << 41 : int64_t(1) << 42);

  // Decode every arrival before using any of it: a malformed one is left out whole.
  std::map<int, torch::Tensor> firsts, phis;
  int64_t failed_blocks = 0;
  for (const auto& [r, bytes] : send(id, group, payload, format, sync)) {
    try {
      const auto* in = bytes.data_ptr<uint8_t>();
      auto first = c.first->decode(in);
      if (with_phi) phis[r] = c.phi_coset ? c.phi_coset->decode(in + first_bytes, own_phi, &failed_blocks)
                                          : c.phi_codec->decode(in + first_bytes);
      firsts[r] = first;
    } catch (const std::runtime_error& e) {
      spdlog::error("rejected the outer-step message of replica {}: {}", r, e.what());
      phis.erase(r);
    }
  }
  sync.phi_blocks_failed = failed_blocks;
  if (with_phi && c.phi_coset && failed_blocks * 10 > int64_t(coset_.blocks(size_t(phi.numel()))))
    spdlog::warn("outer step {}: {} blocks of slow weights were further from a partner's than its grid covered; "
                 "no pull there this time", sync.outer_step, failed_blocks);
  sync.arrived.push_back(transport_.rank());
  for (const auto& [r, t] : firsts) sync.arrived.push_back(r);
  std::sort(sync.arrived.begin(), sync.arrived.end());
  const auto mean_first = rank_ordered_mean(transport_.rank(), own, firsts).to(theta.device());
  if (theta_message) return {mean_first - phi, {}, 0};
  if (!with_phi) return {mean_first, {}, 0};
  return {mean_first, rank_ordered_mean(transport_.rank(), own_phi, phis).to(theta.device()), config_.gamma};
}

}  // namespace noloco
