// Random routing between pipeline stages (SWARM / DiPaCo style): which replica
// of the next stage receives each micro-batch. Computed identically by every
// worker from the run seed, with no communication.
#pragma once
#include <cstdint>
#include <vector>

namespace noloco {

// Where stage s of replica d sends micro-batch `micro` of step `step` across
// boundary s (between stages s and s+1): to stage s+1 of replica perm[d].
// A permutation seeded by (seed, step, micro, boundary); identity if !random.
std::vector<int> route_permutation(uint64_t seed, int64_t step, int64_t micro, int boundary, int replicas,
                                   bool random);

// inverse[perm[d]] == d: the receiver's view, who sent to me.
std::vector<int> invert_permutation(const std::vector<int>& perm);

// The data replica whose tokens reach stage `stage` of replica `replica` for
// this micro-batch: the routes followed backwards to stage 0.
int micro_batch_origin(uint64_t seed, int64_t step, int64_t micro, int stage, int replica, int replicas, bool random);

}  // namespace noloco
