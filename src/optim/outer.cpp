#include "optim/outer.h"

#include "optim/ddp.h"
#include "optim/diloco.h"
#include "optim/noloco.h"
#include "optim/replica_workers.h"

namespace noloco {

namespace {

std::unique_ptr<OuterOptimizer> between_replicas(const OuterConfig& c, uint64_t seed, ReplicaPeers links,
                                                 FlatParams& params) {
  const bool follows = links.replica && links.replica->rank() != 0;
  if (c.method == Method::none || follows) return std::make_unique<OuterOptimizer>();
  TORCH_CHECK(links.transport != nullptr, "method ", choice_name(c.method), " needs a transport");
  switch (c.method) {
    case Method::ddp: return std::make_unique<Ddp>(*links.transport);
    case Method::diloco: return std::make_unique<DiLoCo>(c, seed, *links.transport, params);
    default: return std::make_unique<NoLoCo>(c, seed, links, params);
  }
}

}  // namespace

std::unique_ptr<OuterOptimizer> make_outer_optimizer(const OuterConfig& c, uint64_t seed, ReplicaPeers links,
                                                     FlatParams& params) {
  auto between = between_replicas(c, seed, links, params);
  if (!links.replica) return between;
  return std::make_unique<ReplicaOfWorkers>(*links.replica, std::move(between), c.pace == PaceMode::speed);
}

}  // namespace noloco
