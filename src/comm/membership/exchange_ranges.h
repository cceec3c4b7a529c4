// The exchanges a replica went alone at, as a few ranges of ids, and as the
// text a partner reads from the run's store ("12 5-7 9-9": the exchange it
// reached, then the ranges). An outage makes one range (a replica alone
// meanwhile goes alone at every exchange), so the latest few cover every
// exchange a partner can still be meeting for.
#pragma once
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace noloco {

class ExchangeRanges {
 public:
  static constexpr size_t kKept = 8;
  // Exchange `id`, after every id added before it.
  void add(int64_t id);
  bool covers(int64_t id) const;
  // Whether any range reaches `id` or beyond.
  bool any_from(int64_t id) const;
  // `reached` and the ranges as one line; parse reads it back, and reads
  // anything else (an empty value, another version's) as no ranges.
  std::string text(int64_t reached) const;
  static ExchangeRanges parse(const std::string& text);
  const std::vector<std::pair<int64_t, int64_t>>& ranges() const { return ranges_; }

 private:
  std::vector<std::pair<int64_t, int64_t>> ranges_;  // [first, last], ascending
};

}  // namespace noloco
