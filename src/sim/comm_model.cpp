#include "sim/comm_model.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <stdexcept>

#include "optim/grouping.h"

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

}  // namespace noloco::sim
