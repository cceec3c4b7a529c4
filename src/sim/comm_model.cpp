#include "sim/comm_model.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <limits>
#include <random>
#include <string_view>
#include <stdexcept>

#include "optim/grouping.h"
#include "optim/pace_share.h"
#include "util/parse_number.h"

namespace noloco::sim {

double LogNormal::mean() const { return std::exp(mu + sigma * sigma / 2); }
double LogNormal::stddev() const { return mean() * std::sqrt(std::expm1(sigma * sigma)); }

LogNormal LogNormal::with_unit_mean(double x) {
  const double s2 = std::log1p(x * x);
  return {-s2 / 2, std::sqrt(s2)};
}

double expected_max_of_two(const LogNormal& t) { return (1 + std::erf(t.sigma / 2)) * t.mean(); }

double pair_exchange_closed_form(const LogNormal& t) { return 2 * expected_max_of_two(t); }

namespace {
std::lognormal_distribution<double> dist(const LogNormal& t) { return std::lognormal_distribution<double>(t.mu, t.sigma); }

// Critical path of a reduce over `n` nodes: the right half's root sends to the left's.
double reduce_time(int n, std::mt19937_64& rng, std::lognormal_distribution<double>& d) {
  if (n == 1) return 0;
  const double left = reduce_time(n / 2, rng, d), right = reduce_time(n - n / 2, rng, d);
  return std::max(left, right + d(rng));
}
// Broadcast: the root sends to the other half's root, then both halves continue.
double broadcast_time(int n, std::mt19937_64& rng, std::lognormal_distribution<double>& d) {
  if (n == 1) return 0;
  const double hop = d(rng);
  const double left = broadcast_time(n / 2, rng, d), right = broadcast_time(n - n / 2, rng, d);
  return std::max(left, hop + right);
}
}  // namespace

double simulate_pair_exchange(const LogNormal& t, int samples, uint64_t seed) {
  std::mt19937_64 rng(seed);
  auto d = dist(t);
  double sum = 0;
  for (int i = 0; i < samples; ++i) sum += std::max(d(rng), d(rng)) + std::max(d(rng), d(rng));
  return sum / samples;
}

double simulate_tree_allreduce(int n, const LogNormal& t, int samples, uint64_t seed) {
  if (n < 2) throw std::invalid_argument("a tree all-reduce needs at least 2 replicas");
  std::mt19937_64 rng(seed);
  auto d = dist(t);
  double sum = 0;
  for (int i = 0; i < samples; ++i) sum += reduce_time(n, rng, d) + broadcast_time(n, rng, d);
  return sum / samples;
}

double ring_allreduce_seconds(int n, double bytes, const Link& l) {
  // Reduce-scatter then all-gather: 2·(n−1) steps, each moving bytes/n per link.
  return 2.0 * (n - 1) * l.message(bytes / n);
}

double tree_allreduce_seconds(int n, double bytes, const Link& l) {
  return 2.0 * std::log2(double(n)) * l.message(bytes);
}

double noloco_exchange_seconds(double wire_bytes, const Link& l) { return l.message(wire_bytes); }

IdleResult simulate_idle(int n, int inner_steps, int outer_steps, const LogNormal& step, uint64_t seed) {
  std::mt19937_64 rng(seed);
  auto d = dist(step);
  std::vector<int> members(static_cast<size_t>(n));
  std::iota(members.begin(), members.end(), 0);
  std::vector<double> noloco(static_cast<size_t>(n), 0.0), work(static_cast<size_t>(n));
  double diloco = 0;
  for (int o = 0; o < outer_steps; ++o) {
    // The same draws serve both methods, so the ratio isolates the barrier's cost.
    for (auto& w : work) {
      w = 0;
      for (int h = 0; h < inner_steps; ++h) w += d(rng);
    }
    diloco += *std::max_element(work.begin(), work.end());
    for (int i = 0; i < n; ++i) noloco[size_t(i)] += work[size_t(i)];
    for (const auto& g : noloco_groups(seed, o, members, 2)) {
      double t = 0;
      for (int r : g) t = std::max(t, noloco[size_t(r)]);
      for (int r : g) noloco[size_t(r)] = t;
    }
  }
  return {diloco, *std::max_element(noloco.begin(), noloco.end())};
}

double paced_inner_steps(int inner_steps, double speed, double fastest) {
  return double(inner_steps) * pace_share(1 / speed, 1 / fastest, inner_steps);
}

int64_t steps_in_period(double per_period, int64_t outer_step) {
  const auto upto = [&](int64_t o) { return int64_t(std::floor(double(o) * per_period + 1e-9)); };
  return upto(outer_step + 1) - upto(outer_step);
}

std::vector<double> replica_speeds(const std::string& spec, int n, uint64_t seed) {
  std::vector<double> out;
  constexpr std::string_view kLogNormal = "lognormal:";
  if (spec.rfind(kLogNormal, 0) == 0) {
    const double s = parse_real("speeds", spec.substr(kLogNormal.size()));
    if (!(s >= 0)) throw std::invalid_argument("speeds: lognormal:S needs S >= 0, got " + spec);
    std::mt19937_64 rng(seed);
    std::lognormal_distribution<double> d(-s * s / 2, s);
    for (int i = 0; i < n; ++i) out.push_back(d(rng));
    return out;
  }
  std::vector<double> listed;
  for (size_t start = 0; start <= spec.size();) {
    const size_t comma = std::min(spec.find(',', start), spec.size());
    const double v = parse_real("speeds", spec.substr(start, comma - start));
    if (!(v > 0)) throw std::invalid_argument("speeds: every speed must be positive, got " + spec);
    listed.push_back(v);
    start = comma + 1;
  }
  for (int i = 0; i < n; ++i) out.push_back(listed[size_t(i) % listed.size()]);
  return out;
}

namespace {

// Inner steps done per second over the ideal (each replica at its own pace):
// `steps_of(i)` inner steps per outer step for replica i (steps_in_period), `barrier`
// whether everyone meets (DiLoCo) or pairs do (NoLoCo, waiting at most `late_bound`).
double schedule_throughput(const std::vector<double>& speeds, const std::vector<double>& steps_of, int outer_steps,
                           const LogNormal& step, bool barrier, double late_bound, uint64_t seed) {
  const int n = int(speeds.size());
  std::mt19937_64 rng(seed);
  auto d = dist(step);
  std::vector<int> members(static_cast<size_t>(n), 0);
  std::iota(members.begin(), members.end(), 0);
  std::vector<double> clock(static_cast<size_t>(n), 0.0), arrival(static_cast<size_t>(n), 0.0);
  double steps = 0, ideal_rate = 0;
  for (int i = 0; i < n; ++i) ideal_rate += speeds[size_t(i)] / step.mean();
  for (int o = 0; o < outer_steps; ++o) {
    for (int i = 0; i < n; ++i) {
      double work = 0;
      const int64_t taken = steps_in_period(steps_of[size_t(i)], o);
      for (int64_t h = 0; h < taken; ++h) work += d(rng);
      arrival[size_t(i)] = clock[size_t(i)] + work / speeds[size_t(i)];
      steps += double(taken);
    }
    if (barrier) {
      const double all = *std::max_element(arrival.begin(), arrival.end());
      std::fill(clock.begin(), clock.end(), all);
      continue;
    }
    clock = arrival;
    for (const auto& g : noloco_groups(seed, o, members, 2)) {
      double first = arrival[size_t(g[0])], last = first;
      for (int r : g) {
        first = std::min(first, arrival[size_t(r)]);
        last = std::max(last, arrival[size_t(r)]);
      }
      if (last - first > late_bound) continue;  // not waited for: each goes on alone
      for (int r : g) clock[size_t(r)] = last;
    }
  }
  return steps / *std::max_element(clock.begin(), clock.end()) / ideal_rate;
}

}  // namespace

UnequalResult simulate_unequal(const std::vector<double>& speeds, int diloco_steps, int noloco_steps, int outer_steps,
                               const LogNormal& step, double late_bound, uint64_t seed) {
  const double fastest = *std::max_element(speeds.begin(), speeds.end());
  const auto same = [&](int h) { return std::vector<double>(speeds.size(), double(h)); };
  const auto paced = [&](int h) {
    std::vector<double> out;
    for (double s : speeds) out.push_back(paced_inner_steps(h, s, fastest));
    return out;
  };
  const double unbounded = std::numeric_limits<double>::infinity();
  UnequalResult r;
  r.diloco.today = schedule_throughput(speeds, same(diloco_steps), outer_steps, step, true, unbounded, seed);
  r.diloco.paced = schedule_throughput(speeds, paced(diloco_steps), outer_steps, step, true, unbounded, seed);
  r.noloco.today = schedule_throughput(speeds, same(noloco_steps), outer_steps, step, false, unbounded, seed);
  r.noloco.paced = schedule_throughput(speeds, paced(noloco_steps), outer_steps, step, false, late_bound, seed);
  return r;
}

}  // namespace noloco::sim
