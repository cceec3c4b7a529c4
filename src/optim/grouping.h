// NoLoCo's random groups: computed identically by every replica from the run
// seed and the outer step, with no communication.
#pragma once
#include <cstdint>
#include <vector>

namespace noloco {

// A permutation of `members` seeded by (seed, outer_step), cut into
// consecutive groups of n; a lone leftover joins the last group.
std::vector<std::vector<int>> noloco_groups(uint64_t seed, int64_t outer_step, const std::vector<int>& members,
                                            int n);

// How many of the draws `outer_steps` (most recent first) went by before one
// that put a and b in one group; all of them if none did.
int64_t draws_since_grouped(uint64_t seed, const std::vector<int64_t>& outer_steps, const std::vector<int>& members,
                            int n, int a, int b);

}  // namespace noloco
