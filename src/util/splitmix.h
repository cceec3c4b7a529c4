#pragma once
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

namespace noloco {

// SplitMix64: a cheap, well-mixed hash used to derive every seeded choice
// (sample windows, groupings) from the run seed and a counter.
inline uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Fisher-Yates driven by SplitMix64 from `state`: the same order on every
// platform and standard library (std::shuffle's is the library's own).
template <class T>
void seeded_shuffle(std::vector<T>& items, uint64_t state) {
  for (size_t i = items.size(); i > 1; --i) {
    state = splitmix64(state);
    std::swap(items[i - 1], items[state % i]);
  }
}

}  // namespace noloco
