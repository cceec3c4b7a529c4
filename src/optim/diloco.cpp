#include "optim/diloco.h"

namespace noloco {

DiLoCo::DiLoCo(const OuterConfig& config, Transport& transport, FlatParams& params)
    : SlowWeightsMethod(config, params), transport_(transport) {}

OuterTerms DiLoCo::exchange(int64_t, const torch::Tensor& theta, const torch::Tensor& phi, OuterSync& sync) {
  auto delta = theta - phi;
  const auto sent_before = transport_.stats().bytes_sent;
  transport_.all_reduce_mean(delta);
  sync.bytes = transport_.stats().bytes_sent - sent_before;
  for (int r = 0; r < transport_.world(); ++r) sync.group.push_back(r);
  sync.arrived = sync.group;
  return {delta, {}, 0};
}

}  // namespace noloco
