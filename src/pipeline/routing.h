// Random routing between pipeline stages (SWARM / DiPaCo style): which replica
// of each stage serves each micro-batch. Computed identically by every worker
// from the run seed and the step's live workers, with no communication.
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

// The replicas of each stage that are live for one step (sorted), as the
// step's roster says; all of them when nobody was lost.
using LiveReplicas = std::vector<std::vector<int>>;

// One micro-batch's way through the pipeline.
struct Route {
  int origin = 0;            // the data replica whose tokens it carries
  std::vector<int> replica;  // the replica that serves it at each stage
};

// The routes of micro-batch `micro` of step `step`, one per live replica of
// the first stage, in origin order. A micro-batch follows the permutations
// above through positions 0..replicas-1; a position whose replica is lost at
// a stage is served by a live replica of that stage drawn per (seed, step,
// micro, stage, position), so a lost worker's share spreads over the others.
// With every worker live this is exactly the permutations' routing. Workers
// that joined the running run (replica numbers `replicas` and up) add their
// positions: a first-stage joiner brings its own data, a later-stage one
// takes its share of the stage's micro-batches.
std::vector<Route> live_routes(uint64_t seed, int64_t step, int64_t micro, int replicas, const LiveReplicas& live,
                               bool random);

// Evaluation passes go along each replica's own pipeline (fixed routing): one
// route per live replica of the last stage, lost positions before it served
// as above.
std::vector<Route> evaluation_routes(uint64_t seed, int replicas, const LiveReplicas& live);

}  // namespace noloco
