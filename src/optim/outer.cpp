#include "optim/outer.h"

#include "optim/ddp.h"
#include "optim/diloco.h"
#include "optim/noloco.h"

namespace noloco {

std::unique_ptr<OuterOptimizer> make_outer_optimizer(const OuterConfig& c, uint64_t seed, ReplicaPeers links,
                                                     FlatParams& params) {
  if (c.method == Method::none) return std::make_unique<OuterOptimizer>();
  TORCH_CHECK(links.transport != nullptr, "method ", choice_name(c.method), " needs a transport");
  switch (c.method) {
    case Method::ddp: return std::make_unique<Ddp>(*links.transport);
    case Method::diloco: return std::make_unique<DiLoCo>(c, seed, *links.transport, params);
    default: return std::make_unique<NoLoCo>(c, seed, links, params);
  }
}

}  // namespace noloco
