#include "pipeline/routing.h"

#include <algorithm>
#include <stdexcept>
#include <string>

#include "util/splitmix.h"

namespace noloco {

namespace {

// The replica that serves `position` at `stage`: itself while live, else one
// of the stage's live replicas, drawn from `salt`.
int serving_replica(const std::vector<int>& live, int position, int stage, uint64_t salt) {
  if (live.empty()) throw std::runtime_error("pipeline stage " + std::to_string(stage) + " has no live worker left");
  if (std::binary_search(live.begin(), live.end(), position)) return position;
  return live[size_t(splitmix64(salt ^ splitmix64(uint64_t(stage) * 0x9e37ULL + uint64_t(position))) % live.size())];
}

std::vector<Route> follow(uint64_t seed, int64_t step, int64_t micro, int replicas, const LiveReplicas& live,
                          bool random, const std::vector<int>& starts) {
  const int stages = int(live.size());
  // Workers that joined the run hold replica numbers from `replicas` up; the
  // permutations run over their positions too, so that they are routed to.
  int positions = replicas;
  for (const auto& stage : live)
    if (!stage.empty()) positions = std::max(positions, stage.back() + 1);
  std::vector<std::vector<int>> perms;
  for (int boundary = 0; boundary + 1 < stages; ++boundary)
    perms.push_back(route_permutation(seed, step, micro, boundary, positions, random));
  const uint64_t salt = splitmix64(seed ^ splitmix64(0x7374616e64ULL + uint64_t(step) * 0x10001ULL + uint64_t(micro)));
  std::vector<Route> routes;
  for (int start : starts) {
    Route r;
    r.origin = start;
    int position = start;
    for (int s = 0; s < stages; ++s) {
      if (s > 0) position = perms[size_t(s - 1)][size_t(position)];
      r.replica.push_back(serving_replica(live[size_t(s)], position, s, salt));
    }
    routes.push_back(std::move(r));
  }
  return routes;
}

}  // namespace

std::vector<int> route_permutation(uint64_t seed, int64_t step, int64_t micro, int boundary, int replicas,
                                   bool random) {
  std::vector<int> perm(size_t(std::max(replicas, 0)));
  for (int d = 0; d < replicas; ++d) perm[size_t(d)] = d;
  if (!random) return perm;
  uint64_t state = splitmix64(seed ^ splitmix64(0x726f757465ULL + uint64_t(step)));
  seeded_shuffle(perm, splitmix64(state ^ splitmix64(uint64_t(micro) * 0x10001ULL + uint64_t(boundary))));
  return perm;
}

std::vector<int> invert_permutation(const std::vector<int>& perm) {
  std::vector<int> inverse(perm.size(), -1);
  for (size_t d = 0; d < perm.size(); ++d) inverse.at(size_t(perm[d])) = int(d);
  return inverse;
}

std::vector<Route> live_routes(uint64_t seed, int64_t step, int64_t micro, int replicas, const LiveReplicas& live,
                               bool random) {
  return follow(seed, step, micro, replicas, live, random, live.at(0));
}

std::vector<Route> evaluation_routes(uint64_t seed, int replicas, const LiveReplicas& live) {
  // The positions are fixed, so the stand-ins are too: the same for every evaluation.
  return follow(seed, 0, 0, replicas, live, false, live.back());
}

}  // namespace noloco
