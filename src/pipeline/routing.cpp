#include "pipeline/routing.h"

#include <algorithm>

#include "util/splitmix.h"

namespace noloco {

std::vector<int> route_permutation(uint64_t seed, int64_t step, int64_t micro, int boundary, int replicas,
                                   bool random) {
  std::vector<int> perm(size_t(std::max(replicas, 0)));
  for (int d = 0; d < replicas; ++d) perm[size_t(d)] = d;
  if (!random) return perm;
  uint64_t state = splitmix64(seed ^ splitmix64(0x726f757465ULL + uint64_t(step)));
  state = splitmix64(state ^ splitmix64(uint64_t(micro) * 0x10001ULL + uint64_t(boundary)));
  for (size_t i = perm.size(); i > 1; --i) {  // Fisher-Yates with our own generator: same on every platform
    state = splitmix64(state);
    std::swap(perm[i - 1], perm[state % i]);
  }
  return perm;
}

std::vector<int> invert_permutation(const std::vector<int>& perm) {
  std::vector<int> inverse(perm.size(), -1);
  for (size_t d = 0; d < perm.size(); ++d) inverse.at(size_t(perm[d])) = int(d);
  return inverse;
}

int micro_batch_origin(uint64_t seed, int64_t step, int64_t micro, int stage, int replica, int replicas,
                       bool random) {
  int d = replica;
  for (int boundary = stage - 1; boundary >= 0; --boundary)
    d = invert_permutation(route_permutation(seed, step, micro, boundary, replicas, random))[size_t(d)];
  return d;
}

}  // namespace noloco
