#include "train/evaluation.h"

#include <algorithm>
#include <cmath>

#include "comm/store/run_record.h"
#include "comm/store/store_outage.h"
#include "util/error_text.h"
#include "util/log.h"

namespace noloco {

ReplicaSpread evaluate_across_replicas(int64_t step, Transport& transport, Membership& membership, FlatParams& flat,
                                       WorkerModel& model) {
  ReplicaSpread out;
  torch::NoGradGuard no_grad;
  auto& theta = flat.values();
  if (store_outage().ongoing()) return out;  // no agreed members to average with
  try {
    const auto name = record::evaluation_snapshot(step);
    const auto members = membership.snapshot(name);
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
    // The first live replica (in a pipeline: of every stage, while none is lost) evaluates the mean model.
    if (model.evaluates_mean_model(group->rank())) {
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
