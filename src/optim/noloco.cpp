#include "optim/noloco.h"

#include <algorithm>

#include "comm/store/run_record.h"
#include "comm/store/store_outage.h"
#include "util/log.h"
#include "util/splitmix.h"

namespace noloco {

namespace {

// The mean of this replica's own values and the others' decoded ones, summed
// in rank order from zero; with `weights` (by rank, pace=speed) each value
// weighed by its replica's steps: Σ w_r·x_r / Σ w_r.
torch::Tensor rank_ordered_mean(int me, const torch::Tensor& own, const std::map<int, torch::Tensor>& others,
                                const std::map<int, int64_t>* weights = nullptr) {
  std::vector<int> ranks{me};
  for (const auto& [r, t] : others) ranks.push_back(r);
  std::sort(ranks.begin(), ranks.end());
  auto sum = torch::zeros(own.sizes(), torch::kFloat32);
  double total = 0;
  for (int r : ranks) {
    const double w = weights ? double(weights->at(r)) : 1.0;
    sum.add_(r == me ? own : others.at(r), w);
    total += w;
  }
  return sum.div_(total);
}

// pace=speed: each payload ends in its sender's PaceReport; read and cut off.
// A payload too short for one is left whole for the decoder to refuse.
std::map<int, PaceReport> take_pace_reports(std::map<int, torch::Tensor>& arrived) {
  std::map<int, PaceReport> reports;
  for (auto it = arrived.begin(); it != arrived.end();) {
    const int64_t n = it->second.numel() - PaceReport::kBytes;
    try {
      if (n < 0) throw std::runtime_error("its message is shorter than a pace report");
      reports[it->first] = PaceReport::from_bytes(it->second.data_ptr<uint8_t>() + n, PaceReport::kBytes);
      it->second = it->second.narrow(0, 0, n);
      ++it;
    } catch (const std::runtime_error& e) {
      spdlog::error("rejected the outer-step message of replica {}: {}", it->first, e.what());
      it = arrived.erase(it);
    }
  }
  return reports;
}

// A partner's increment (θ − φ, how far its weights are from this replica's
// slow weights, where its message tells θ; else its Δ) is refused as diverged
// when its norm exceeds this many times the largest increment this replica
// has met over its last kIncrementHistory outer steps (this one included): its
// own and the partners' it took. Healthy replicas on one schedule differ only
// by their data (at most 1.5 times in the measured runs, θ, sparse and top-k;
// docs/failures.md); a replica that blew up is 47 to 253 times off. Its own history keeps a replica that blew
// up, whose AdamW moments then shrink its own steps for a while, from refusing
// its healthy partners in turn. Nothing is judged before the window holds a
// partner's increment: replicas started apart (the Python door lets each seed
// its own model) are far from each other at first, and the pull brings them close.
constexpr double kDivergedRatio = 10.0;
constexpr size_t kIncrementHistory = 4;

}  // namespace

NoLoCo::NoLoCo(const OuterConfig& config, uint64_t seed, ReplicaPeers links, FlatParams& params)
    : SlowWeightsMethod(config, params, links.transport->rank()),
      seed_(seed),
      transport_(*links.transport),
      membership_(links.membership),
      codec_(codec_spec(config)),
      coset_(int(config.phi_bits), config.quant_block),
      increments_(fragments().size()),
      period_began_(fragments().size(), std::chrono::steady_clock::now()) {
  for (const auto& f : fragments())
    messages_.emplace_back(config, codec_, coset_, f.numel,
                           [&](const std::string& name) { return fragment_state(name, f); },
                           low_rank_coding(params, f.offset, f.numel, config.message_rank));
}

std::string NoLoCo::increments_key(size_t fragment) { return "outer.increment_norms." + std::to_string(fragment); }

void NoLoCo::save(TensorMap& out) const {
  SlowWeightsMethod::save(out);  // first: it waits for an exchange in flight, which uses the channels
  for (const auto& m : messages_) m.save(out);
  for (size_t f = 0; f < increments_.size(); ++f) {
    std::vector<double> norms;
    for (const auto& met : increments_[f]) norms.insert(norms.end(), {met.own, met.taken});
    out[increments_key(f)] = torch::tensor(norms, torch::kFloat64).reshape({int64_t(increments_[f].size()), 2});
  }
}

void NoLoCo::load(const TensorMap& in) {
  SlowWeightsMethod::load(in);
  for (auto& m : messages_) m.load(in);
  for (size_t f = 0; f < increments_.size(); ++f) {
    increments_[f].clear();
    const auto it = in.find(increments_key(f));
    if (it == in.end()) continue;  // a state saved before the bound: it starts afresh
    const auto norms = it->second.to(torch::kFloat64).reshape({it->second.numel() / 2, 2});
    for (int64_t i = 0; i < std::min<int64_t>(norms.size(0), int64_t(kIncrementHistory)); ++i)
      increments_[f].push_back({norms[i][0].item<double>(), norms[i][1].item<double>()});
  }
}

std::vector<Peer> NoLoCo::my_group(int64_t id, OuterSync& sync) {
  std::vector<Peer> members;
  if (membership_) {
    try {
      membership_->reach_exchange(id);
      // Without the store there is no agreed snapshot: alone, until it answers again.
      if (store_outage().ongoing()) return alone_without_store(id, sync);
      members = membership_->snapshot(record::outer_step_snapshot(id));
    } catch (const StoreUnreachable&) {
      return alone_without_store(id, sync);
    }
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
  request.partner_wait = partner_wait(sync.fragment);
  if (sync.pace) request.note = sync.pace->to_bytes();  // read by a partner left behind: it learns its pace
  const auto sent_before = transport_.stats().bytes_sent;
  // Peers it gives up are declared dead by the transport (later snapshots leave them out).
  ExchangeResult result;
  try {
    if (group.size() > 1) result = transport_.exchange(request);
  } catch (const StoreUnreachable&) {  // the group could not meet: this outer step alone
    sync.store_unreachable = true;
    if (membership_) membership_->go_alone(id);
  }
  sync.bytes = transport_.stats().bytes_sent - sent_before;
  period_began_[size_t(sync.fragment)] = std::chrono::steady_clock::now();
  sync.behind = result.behind;
  // It came at least the wait after its partners.
  if (result.left_behind) sync.left_behind_by = std::chrono::duration<double>(request.partner_wait).count();
  if (sync.pace)
    for (const auto& [r, note] : result.notes) try {
        sync.partners_pace[r] = PaceReport::from_bytes(note.data(), int64_t(note.size()));
      } catch (const std::runtime_error& e) {
        spdlog::warn("outer step {}: replica {}'s pace note not used: {}", sync.outer_step, r, e.what());
      }
  return std::move(result.received);
}

std::chrono::milliseconds NoLoCo::partner_wait(int fragment) const {
  if (config_.partner_wait <= 0) return std::chrono::milliseconds(0);
  const auto trained = std::chrono::steady_clock::now() - period_began_[size_t(fragment)];
  // At least a millisecond: a wait of 0 would mean none, and the run's members must agree there is one.
  return std::max(std::chrono::milliseconds(1),
                  std::chrono::duration_cast<std::chrono::milliseconds>(trained * config_.partner_wait));
}

std::vector<Peer> NoLoCo::alone_without_store(int64_t id, OuterSync& sync) const {
  sync.store_unreachable = true;
  membership_->go_alone(id);
  sync.members = {transport_.rank()};
  return {membership_->self()};
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
                                          bool with_phi, const NolocoParts& own, const std::vector<Peer>& group,
                                          const std::map<int, int64_t>& separations, OuterSync& sync) {
  std::map<int, NolocoParts> decoded;
  const int64_t values = message.values(with_phi);
  // θ − φ wherever θ can be known, Δ with φ included: a partner that blew up
  // an outer step ago sends a small Δ on a φ thrown off.
  const bool theta_message = message.carries_theta();
  const auto increment = [&](const NolocoParts& parts) {
    if (theta_message) return (parts.first - own.phi).norm().item<double>();
    return (with_phi ? parts.first + parts.phi - own.phi : parts.first).norm().item<double>();
  };
  auto& history = increments_[size_t(sync.fragment)];
  history.push_back({increment(own), 0.0});
  if (history.size() > kIncrementHistory) history.pop_front();
  double scale = 0;
  bool judged = false;
  for (const auto& met : history) {
    scale = std::max({scale, met.own, met.taken});
    judged = judged || met.taken > 0;
  }
  for (const auto& [r, bytes] : arrived) {
    sync.values_received += values;
    const int64_t failed_before = sync.phi_blocks_failed;
    const int64_t separation = with_phi ? separations.at(r) : 0;
    try {
      auto parts = message.decode(bytes, with_phi, own.phi, separation, &sync.phi_blocks_failed);
      sync.values_dropped += std::min(values, (sync.phi_blocks_failed - failed_before) * int64_t(coset_.block()));
      const double norm = increment(parts);
      const double ratio = scale > 0 ? norm / scale : 0.0;
      sync.largest_increment_ratio = std::max(sync.largest_increment_ratio, ratio);
      if (judged && ratio > kDivergedRatio) {
        spdlog::error("outer step {}: refused replica {}'s message as diverged: its increment is {:.3g} times the "
                      "largest this replica met lately (at most {:g} is taken); it is told to take a live "
                      "replica's state",
                      sync.outer_step, r, ratio, kDivergedRatio);
        sync.values_dropped += values;
        sync.refused.push_back(r);
        const auto peer = std::find_if(group.begin(), group.end(), [&](const Peer& p) { return p.rank == r; });
        if (membership_ && peer != group.end()) membership_->refuse_as_diverged(*peer, sync.outer_step);
        continue;
      }
      history.back().taken = std::max(history.back().taken, norm);
      decoded[r] = std::move(parts);
    } catch (const std::runtime_error& e) {
      spdlog::error("rejected the outer-step message of replica {}: {}", r, e.what());
      sync.values_dropped += values;
    }
  }
  if (membership_ && membership_->refused_as_diverged()) sync.diverged = true;
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
  auto payload = message.encode(own, with_phi, farthest, seed, &leftover);
  if (sync.pace) {
    const auto report = sync.pace->to_bytes();
    payload = torch::cat({payload, torch::tensor(std::vector<int64_t>(report.begin(), report.end())).to(torch::kUInt8)});
  }
  // residual=weights: this replica's Δ counts as its message carries it, as
  // its partners' do (and is judged against theirs so), and what the message
  // left out stays in its weights (under top-k, where no partner's message
  // carried the value: mean_standing_in_for_unsent).
  torch::Tensor own_first = own.first, kept;
  if (leftover.defined()) {
    own_first = own.first - leftover;
    kept = leftover * config_.error_feedback_decay;
  }
  auto arrived = send(id, group, payload, message.format_id(with_phi), sync);
  if (sync.pace)
    for (const auto& [r, report] : take_pace_reports(arrived)) sync.partners_pace[r] = report;
  const auto decoded = decode(message, arrived, with_phi, {own_first, own.phi}, group, separations, sync);
  std::map<int, int64_t> steps;  // pace=speed: the increments' weights
  if (sync.pace) {
    steps[transport_.rank()] = sync.pace->steps;
    for (const auto& [r, parts] : decoded) steps[r] = sync.partners_pace.at(r).steps;
  }
  const auto* weights = sync.pace ? &steps : nullptr;

  // The means over this replica's values (exact, or as sent under residual=weights) and what it
  // decoded, in rank order.
  std::map<int, torch::Tensor> firsts, phis;
  for (const auto& [r, parts] : decoded) {
    firsts[r] = parts.first;
    if (with_phi) phis[r] = parts.phi;
  }
  torch::Tensor mean_first;
  if (kept.defined() && config_.topk > 0) {
    std::vector<torch::Tensor> sent;
    std::vector<double> sent_weights;
    size_t own_index = 0;
    firsts[transport_.rank()] = own_first;
    for (const auto& [r, values] : firsts) {  // in rank order
      if (r == transport_.rank()) own_index = sent.size();
      sent.push_back(values);
      sent_weights.push_back(weights ? double(weights->at(r)) : 1.0);
    }
    mean_first = mean_standing_in_for_unsent(sent, own_index, own.first, sent_weights, kept);
  } else {
    mean_first = rank_ordered_mean(transport_.rank(), own_first, firsts, weights);
  }
  mean_first = mean_first.to(theta.device());
  if (kept.defined()) kept = kept.to(theta.device());
  if (theta_message) return {mean_first - phi, {}, 0, {}};
  if (!with_phi) return {mean_first, {}, 0, kept};
  return {mean_first, rank_ordered_mean(transport_.rank(), own.phi, phis).to(theta.device()), config_.gamma, kept};
}

}  // namespace noloco
