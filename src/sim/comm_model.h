// Models of what synchronisation costs at scales this machine cannot host
// (the paper's Section 5): message latency, bandwidth and idle time. Pure
// functions of their arguments and a seed; torch-free.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace noloco::sim {

// Message times t ~ LogNormal(mu, sigma).
struct LogNormal {
  double mu = 0, sigma = 0;
  double mean() const;
  double stddev() const;
  // The distribution with mean 1 and std/mean = x (the paper's std(t)/t_c).
  static LogNormal with_unit_mean(double relative_std);
};

// E[max(t1, t2)] for two independent message times = (1 + erf(σ/2))·exp(μ + σ²/2).
double expected_max_of_two(const LogNormal& t);
// A group-of-two exchange: the value goes to the partner and the result comes
// back, two rounds each waiting for the slower of two messages. Closed form 2·E[max].
double pair_exchange_closed_form(const LogNormal& t);

// Monte-Carlo means over `samples` draws.
double simulate_pair_exchange(const LogNormal& t, int samples, uint64_t seed);
// Tree all-reduce over n = 2^k replicas: a reduce up a binary tree then a
// broadcast down, each node waiting only for its own children (critical
// path, no global barrier per level). Equals 2·t_c·log2 n when σ = 0.
double simulate_tree_allreduce(int n, const LogNormal& t, int samples, uint64_t seed);

// Bandwidth model: time for one synchronisation of `model_bytes` (fp32) over
// links of `bandwidth` bytes/s and round-trip time `rtt` seconds.
struct Link {
  double bandwidth = 0, rtt = 0;
  double message(double bytes) const { return bytes / bandwidth + rtt / 2; }
};
double ring_allreduce_seconds(int n, double bytes, const Link& l);
double tree_allreduce_seconds(int n, double bytes, const Link& l);
// NoLoCo with γ = β: θ once in each direction, concurrently (full duplex).
double noloco_exchange_seconds(double wire_bytes, const Link& l);

// Idle time: inner-step times LogNormal(step) per replica per step. DiLoCo's
// outer step is a barrier over all replicas; NoLoCo's only over its group.
// Returns wall-clock until the last replica finishes `outer_steps` outer steps.
struct IdleResult {
  double diloco_seconds = 0, noloco_seconds = 0;
  double ratio() const { return diloco_seconds / noloco_seconds; }
};
IdleResult simulate_idle(int n, int inner_steps, int outer_steps, const LogNormal& step, uint64_t seed);

// Unequal machines: replica i takes each inner step in step / speeds[i].
// Today's schedule gives every replica H inner steps per outer step, so a
// pair (DiLoCo: every replica) waits for its slower member, and a replica
// that is always slow sets its partners' pace, and theirs their partners'.
// The paced schedule (pace=speed, optim/pace.h) gives replica i
// paced_inner_steps(H, speeds[i], fastest) steps, so that all reach each
// outer step together whatever their
// speed; a NoLoCo replica waits for its partner at most `late_bound`
// seconds, past which both go on alone. Work is counted in inner steps; the
// ideal is every replica at its own pace, never waiting.
struct ScheduleThroughput {
  double today = 0, paced = 0;  // inner steps per second over the ideal
};
struct UnequalResult {
  ScheduleThroughput diloco, noloco;
};
UnequalResult simulate_unequal(const std::vector<double>& speeds, int diloco_steps, int noloco_steps, int outer_steps,
                               const LogNormal& step, double late_bound, uint64_t seed);
// A replica's inner steps per outer step when paced, on average: H·speed/fastest
// in [1, H], H within 10% of the fastest (optim/pace_share.h).
double paced_inner_steps(int inner_steps, double speed, double fastest);
// The whole steps of period `outer_step` at `per_period` steps on average:
// the fraction carried, as optim/pace.h does (16.7 a period: 16, 17, 17, ...).
int64_t steps_in_period(double per_period, int64_t outer_step);
// The speeds of `n` replicas from `spec`: "1,1,1,0.33" (repeated over the
// replicas) or "lognormal:S" (mean 1, the log's standard deviation S).
// Throws std::invalid_argument naming a malformed spec.
std::vector<double> replica_speeds(const std::string& spec, int n, uint64_t seed);

}  // namespace noloco::sim
