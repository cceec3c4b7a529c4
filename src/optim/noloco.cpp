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

NoLoCo::NoLoCo(const OuterConfig& config, uint64_t seed, ReplicaPeers links, FlatParams& params)
    : SlowWeightsMethod(config, params),
      seed_(seed),
      transport_(*links.transport),
      membership_(links.membership),
      codec_(codec_spec(config)),
      coset_(int(config.phi_bits), config.quant_block) {
  for (const auto& f : fragments())
    messages_.emplace_back(config, codec_, coset_, f.numel,
                           [&](const std::string& name) { return fragment_state(name, f); },
                           low_rank_coding(params, f.offset, f.numel, config.message_rank));
}

void NoLoCo::save(TensorMap& out) const {
  SlowWeightsMethod::save(out);  // first: it waits for an exchange in flight, which uses the channels
  for (const auto& m : messages_) m.save(out);
}

void NoLoCo::load(const TensorMap& in) {
  SlowWeightsMethod::load(in);
  for (auto& m : messages_) m.load(in);
}

std::vector<Peer> NoLoCo::my_group(int64_t id, OuterSync& sync) {
  std::vector<Peer> members;
  if (membership_) {
    members = membership_->snapshot(std::to_string(id));
  } else {
    for (int r = 0; r < transport_.world(); ++r) members.push_back({r, 0});
  }
  std::vector<int> ranks;
  for (const auto& p : members) ranks.push_back(p.rank);
  sync.members = ranks;
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
  const auto sent_before = transport_.stats().bytes_sent;
  // Peers it gives up are declared dead by the transport (later snapshots leave them out).
  auto result = group.size() > 1 ? transport_.exchange(request) : ExchangeResult{};
  sync.bytes = transport_.stats().bytes_sent - sent_before;
  return std::move(result.received);
}

int64_t NoLoCo::phi_separation(const OuterSync& sync, const Fragment& fragment, int partner) const {
  std::vector<int64_t> earlier;  // the fragment's φ exchanges before this one, as exchange ids
  const int64_t fragments = int64_t(this->fragments().size());
  for (int64_t s = sync.outer_step - config_.phi_every; s >= 0 && int64_t(earlier.size()) < kSeparationHorizon;
       s -= config_.phi_every)
    earlier.push_back(s * fragments + fragment.index);
  return draws_since_grouped(seed_, earlier, sync.members, int(config_.group_size), transport_.rank(), partner);
}

std::map<int, NolocoParts> NoLoCo::decode(NolocoMessageCodec& message, const std::map<int, torch::Tensor>& arrived,
                                          bool with_phi, const torch::Tensor& own_phi,
                                          const std::map<int, int64_t>& separations, OuterSync& sync) {
  std::map<int, NolocoParts> decoded;
  const int64_t values = message.values(with_phi);
  for (const auto& [r, bytes] : arrived) {
    sync.values_received += values;
    const int64_t failed_before = sync.phi_blocks_failed;
    const int64_t separation = with_phi ? separations.at(r) : 0;
    try {
      decoded[r] = message.decode(bytes, with_phi, own_phi, separation, &sync.phi_blocks_failed);
      sync.values_dropped += std::min(values, (sync.phi_blocks_failed - failed_before) * int64_t(coset_.block()));
    } catch (const std::runtime_error& e) {
      spdlog::error("rejected the outer-step message of replica {}: {}", r, e.what());
      sync.values_dropped += values;
    }
  }
  if (sync.phi_blocks_failed * 10 > message.phi_blocks())
    spdlog::warn("outer step {}: {} blocks of slow weights were further from a partner's than its grid covered; "
                 "no pull there this time", sync.outer_step, sync.phi_blocks_failed);
  sync.arrived.push_back(transport_.rank());
  for (const auto& [r, parts] : decoded) sync.arrived.push_back(r);
  std::sort(sync.arrived.begin(), sync.arrived.end());
  return decoded;
}

OuterTerms NoLoCo::group_means(int64_t id, const Fragment& fragment, const torch::Tensor& theta,
                               const torch::Tensor& phi, OuterSync& sync) {
  const auto group = my_group(id, sync);
  auto& message = messages_[size_t(fragment.index)];
  const bool theta_message = message.carries_theta();
  const bool with_phi = !theta_message && config_.phi_every > 0 && (sync.outer_step + 1) % config_.phi_every == 0;
  const NolocoParts own{cpu_fp32(theta_message ? theta : theta - phi), cpu_fp32(phi)};
  const uint64_t seed = splitmix64(seed_ ^ splitmix64(uint64_t(id) * 1000003u + uint64_t(transport_.rank())));
  std::map<int, int64_t> separations;  // by partner; the grid is sent for the farthest
  int64_t farthest = 0;
  for (const auto& p : group)
    if (with_phi && p.rank != transport_.rank()) {
      separations[p.rank] = phi_separation(sync, fragment, p.rank);
      farthest = std::max(farthest, separations[p.rank]);
    }
  torch::Tensor leftover;
  const auto payload = message.encode(own, with_phi, farthest, seed, &leftover);
  const auto arrived = send(id, group, payload, message.format_id(with_phi), sync);
  const auto decoded = decode(message, arrived, with_phi, own.phi, separations, sync);
  // residual=weights: this replica's Δ counts as its message carries it, as
  // its partners' do, and what the message left out stays in its weights.
  torch::Tensor own_first = own.first, kept;
  if (leftover.defined()) {
    own_first = own.first - leftover;
    kept = (leftover * config_.error_feedback_decay).to(theta.device());
  }

  // The means over this replica's values (exact, or as sent under residual=weights) and what it
  // decoded, in rank order.
  std::map<int, torch::Tensor> firsts, phis;
  for (const auto& [r, parts] : decoded) {
    firsts[r] = parts.first;
    if (with_phi) phis[r] = parts.phi;
  }
  const auto mean_first = rank_ordered_mean(transport_.rank(), own_first, firsts).to(theta.device());
  if (theta_message) return {mean_first - phi, {}, 0, {}};
  if (!with_phi) return {mean_first, {}, 0, kept};
  return {mean_first, rank_ordered_mean(transport_.rank(), own.phi, phis).to(theta.device()), config_.gamma, kept};
}

}  // namespace noloco
