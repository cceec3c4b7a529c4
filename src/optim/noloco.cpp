#include "optim/noloco.h"

#include <algorithm>

namespace noloco {

NoLoCo::NoLoCo(const OuterConfig& config, uint64_t seed, OuterLinks links, FlatParams& params)
    : SlowWeightsMethod(config, params), seed_(seed), transport_(*links.transport), membership_(links.membership) {}

std::vector<Peer> NoLoCo::my_group(int64_t outer_step) {
  std::vector<Peer> members;
  if (membership_) {
    members = membership_->snapshot(std::to_string(outer_step));
  } else {
    for (int r = 0; r < transport_.world(); ++r) members.push_back({r, 0});
  }
  std::vector<int> ranks;
  for (const auto& p : members) ranks.push_back(p.rank);
  for (const auto& g : noloco_groups(seed_, outer_step, ranks, int(config_.group_size))) {
    if (std::find(g.begin(), g.end(), transport_.rank()) == g.end()) continue;
    std::vector<Peer> group;
    for (int r : g)
      group.push_back(*std::find_if(members.begin(), members.end(), [&](const Peer& p) { return p.rank == r; }));
    return group;
  }
  // Left out of this snapshot (restarted, or thought dead): alone this time.
  return {membership_ ? membership_->self() : Peer{transport_.rank(), 0}};
}

torch::Tensor NoLoCo::group_mean(int64_t outer_step, const std::vector<Peer>& group, const torch::Tensor& payload,
                                 OuterSync& sync) {
  for (const auto& p : group) sync.group.push_back(p.rank);
  const auto local = payload.contiguous();
  ExchangeRequest request;
  request.id = outer_step;
  request.group = group;
  request.header.kind = int64_t(MessageKind::exchange);
  request.header.exchange = outer_step;
  request.header.bytes = int64_t(local.nbytes());
  request.header.format = int64_t(local.scalar_type());
  request.payload = local.view(torch::kUInt8);
  if (membership_) request.give_up = [this](int r) { return membership_->given_up(r); };
  const auto sent_before = transport_.stats().bytes_sent;
  const auto result = group.size() > 1 ? transport_.exchange(request) : ExchangeResult{};
  sync.bytes = transport_.stats().bytes_sent - sent_before;
  if (membership_)
    for (int r : result.lost) membership_->declare_dead(r);  // later snapshots leave it out
  sync.arrived.push_back(transport_.rank());
  for (const auto& [r, bytes] : result.received) sync.arrived.push_back(r);
  std::sort(sync.arrived.begin(), sync.arrived.end());
  auto sum = torch::zeros(local.sizes(), torch::kFloat32);
  for (int r : sync.arrived)
    sum.add_(r == transport_.rank() ? local : result.received.at(r).view(local.scalar_type()));
  return sum.div_(double(sync.arrived.size()));
}

OuterTerms NoLoCo::exchange(int64_t outer_step, const torch::Tensor& theta, const torch::Tensor& phi,
                            OuterSync& sync) {
  const auto group = my_group(outer_step);
  auto wire = [&](const torch::Tensor& t) { return config_.wire_dtype == "bf16" ? t.to(torch::kBFloat16) : t; };
  if (config_.message == "theta") {
    // β·mean(Δ) + β·(mean φ − φ_i) = β·(mean θ − φ_i): only θ travels.
    const auto mean_theta = group_mean(outer_step, group, wire(theta), sync);
    return {mean_theta - phi, {}, 0};
  }
  const int64_t n = phi.numel();
  const auto both = group_mean(outer_step, group, wire(torch::cat({theta - phi, phi})), sync);
  return {both.narrow(0, 0, n), both.narrow(0, n, n), config_.gamma};
}

}  // namespace noloco
