#include "comm/membership/exchange_ranges.h"

#include <algorithm>
#include <sstream>

namespace noloco {

void ExchangeRanges::add(int64_t id) {
  if (!ranges_.empty() && ranges_.back().second >= id) return;
  if (!ranges_.empty() && ranges_.back().second + 1 == id) {
    ranges_.back().second = id;
    return;
  }
  ranges_.emplace_back(id, id);
  if (ranges_.size() > kKept) ranges_.erase(ranges_.begin());
}

bool ExchangeRanges::covers(int64_t id) const {
  return std::any_of(ranges_.begin(), ranges_.end(), [&](const auto& r) { return r.first <= id && id <= r.second; });
}

bool ExchangeRanges::any_from(int64_t id) const { return !ranges_.empty() && ranges_.back().second >= id; }

std::string ExchangeRanges::text(int64_t reached) const {
  std::string out = std::to_string(reached);
  for (const auto& [first, last] : ranges_) out += " " + std::to_string(first) + "-" + std::to_string(last);
  return out;
}

ExchangeRanges ExchangeRanges::parse(const std::string& text) {
  ExchangeRanges out;
  std::istringstream in(text);
  int64_t reached = 0, first = 0, last = 0;
  char dash = 0;
  if (!(in >> reached)) return out;
  while (out.ranges_.size() < kKept && in >> first >> dash >> last) {
    if (dash != '-' || last < first || (!out.ranges_.empty() && first <= out.ranges_.back().second)) return {};
    out.ranges_.emplace_back(first, last);
  }
  return out;
}

}  // namespace noloco
