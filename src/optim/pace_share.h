// The share of a period's H slots a replica trains under pace=speed
// (optim/pace.h), shared with the simulator (sim/comm_model.h).
#pragma once
#include <algorithm>
#include <cstdint>

namespace noloco {

// Step times within this share of the reference count as equal: the
// fastest of several equal machines' noisy averages is below their typical
// one, and would otherwise have every replica skip a slot or two a period.
constexpr double kEqualPaceBand = 0.1;

// reference / own step time, in [1/H, 1]; 1 within kEqualPaceBand or when either is unknown (0).
inline double pace_share(double own_seconds, double reference_seconds, int64_t interval) {
  if (!(reference_seconds > 0) || !(own_seconds > reference_seconds * (1 + kEqualPaceBand))) return 1.0;
  return std::clamp(reference_seconds / own_seconds, 1.0 / double(interval), 1.0);
}

}  // namespace noloco
