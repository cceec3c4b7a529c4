#include "optim/grouping.h"

#include <algorithm>

#include "util/splitmix.h"

namespace noloco {

std::vector<std::vector<int>> noloco_groups(uint64_t seed, int64_t outer_step,
                                            const std::vector<int>& members, int n) {
  std::vector<int> order = members;
  std::sort(order.begin(), order.end());
  seeded_shuffle(order, splitmix64(seed ^ splitmix64(uint64_t(outer_step) + 0x6e6f6c6f636fULL)));
  std::vector<std::vector<int>> groups;
  for (size_t i = 0; i < order.size(); i += size_t(n)) {
    std::vector<int> g(order.begin() + long(i), order.begin() + long(std::min(order.size(), i + size_t(n))));
    if (g.size() == 1 && !groups.empty()) {
      groups.back().push_back(g[0]);
    } else {
      groups.push_back(std::move(g));
    }
  }
  for (auto& g : groups) std::sort(g.begin(), g.end());
  return groups;
}

int64_t draws_since_grouped(uint64_t seed, const std::vector<int64_t>& outer_steps, const std::vector<int>& members,
                            int n, int a, int b) {
  for (size_t k = 0; k < outer_steps.size(); ++k)
    for (const auto& g : noloco_groups(seed, outer_steps[k], members, n))
      if (std::find(g.begin(), g.end(), a) != g.end() && std::find(g.begin(), g.end(), b) != g.end())
        return int64_t(k);
  return int64_t(outer_steps.size());
}

}  // namespace noloco
