#include "train/evaluation.h"

#include <algorithm>
#include <cmath>

#include "comm/store/run_record.h"
#include "comm/store/store_outage.h"
#include "util/error_text.h"
#include "util/splitmix.h"
#include "util/log.h"

namespace noloco {

std::vector<Peer> spread_sample(uint64_t seed, int64_t step, const std::vector<Peer>& members, int64_t k) {
  if (k == 0 || int64_t(members.size()) <= k) return members;
  std::vector<Peer> rest(members.begin() + 1, members.end());
  seeded_shuffle(rest, splitmix64(seed ^ splitmix64(uint64_t(step) + 0x737072656164ULL)));
  std::vector<Peer> sample = {members.front()};
  sample.insert(sample.end(), rest.begin(), rest.begin() + long(k - 1));
  std::sort(sample.begin(), sample.end(), [](const Peer& a, const Peer& b) { return a.rank < b.rank; });
  return sample;
}

ReplicaSpread evaluate_across_replicas(int64_t step, uint64_t seed, int64_t k, Transport& transport,
                                       Membership& membership, FlatParams& flat, WorkerModel& model, bool validates) {
  ReplicaSpread out;
  torch::NoGradGuard no_grad;
  auto& theta = flat.values();
  if (store_outage().ongoing()) return out;  // no agreed members to average with
  try {
    const auto name = record::evaluation_snapshot(step);
    const auto live = membership.snapshot(name);
    out.live_replicas = int(live.size());
    const auto members = spread_sample(seed, step, live, k);
    if (members.size() < 2 || std::find(members.begin(), members.end(), membership.self()) == members.end())
      return out;
    const auto group = transport.subgroup(name, members);
    auto mean = theta.clone();
    group->all_reduce_mean(mean);
    // The spread is one number: the mean over weights of the mean over
    // replicas of the squared deviation. Both means are linear, so each
    // replica reduces its own deviation to a scalar first and only that
    // crosses the network (a second weight-sized mean doubled the traffic).
    auto deviation = (theta - mean).square().mean(torch::kFloat64).reshape({1});
    group->all_reduce_mean(deviation);
    out.bytes_sent = group->stats().bytes_sent;
    out.weight_std = std::sqrt(deviation.item<double>());
    out.replicas = int(members.size());
    // The first live replica (in a pipeline: of every stage, while none is lost) evaluates the mean model.
    if (validates && model.evaluates_mean_model(group->rank())) {
      auto own = theta.clone();
      theta.copy_(mean);
      out.mean_model_loss = model.evaluate(step);
      theta.copy_(own);
    }
  } catch (const std::exception& e) {
    spdlog::warn("mean-model evaluation skipped: {}", error_text(e));
  }
  return out;
}

}  // namespace noloco
