// A replica's own group over NCCL, where its workers are one node's GPUs: the
// gradients' all-reduce of every inner step stays on the GPUs' links (NVLink,
// PCIe) instead of crossing to the host for Gloo. It carries collectives
// only, unsealed: the node's links are not the network sealing guards, and
// NCCL reduces the bytes it carries (a sealed run keeps Gloo).
#pragma once
#include <chrono>
#include <memory>
#include <string>

#include "comm/store/store.h"
#include "comm/transport/transport.h"

namespace noloco {

// Whether this build has NCCL: a CUDA LibTorch with c10d's NCCL group (pip's;
// Debian's LibTorch has no CUDA).
bool nccl_built();

// Member `rank` of the `world` members of group `name` in `store`, on `device`
// (cuda:N, its own GPU). A collective waits for the others up to `timeout`.
std::unique_ptr<Collectives> join_nccl_group(const StorePtr& store, const std::string& name, int rank, int world,
                                           const std::string& device, std::chrono::milliseconds timeout);

}  // namespace noloco
