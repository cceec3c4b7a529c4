// Outer methods wrap the inner optimizer without changing the training loop:
// the loop calls on_gradients() after backward and after_inner_step() after
// each AdamW step; a method acts in whichever hook it needs. One class per
// method: ddp.h, diloco.h, noloco.h.
#pragma once
#include <memory>
#include <optional>
#include <vector>

#include <torch/torch.h>

#include "comm/membership/membership.h"
#include "comm/transport/transport.h"
#include "config/train_config.h"
#include "optim/flat_params.h"
#include "optim/inner.h"
#include "optim/pace.h"

namespace noloco {

// What an outer step did, for the metrics log.
struct OuterSync {
  int64_t outer_step = 0;
  int fragment = 0;          // which fragment of the weights (fragments=F)
  std::vector<int> members;  // the live replicas its grouping was drawn from
  std::vector<int> group;    // who it averaged with (all replicas for DiLoCo)
  std::vector<int> arrived;  // of those, whose data was counted
  uint64_t bytes = 0;        // bytes this replica sent for it (message headers included)
  int64_t phi_blocks_failed = 0;  // coset-coded blocks that fell outside their grid (kept unpulled)
  // Values in the peers' messages that arrived (Δ or θ, and φ when it
  // travelled), and of those the ones this replica could not use: a whole
  // rejected message, a φ block outside its grid.
  int64_t values_received = 0, values_dropped = 0;
  // Partners whose message it refused as diverged (NoLoCo: an increment far
  // larger than its own), and the largest ratio of a partner's increment to
  // its own, where a replica drifting off shows first.
  std::vector<int> refused;
  double largest_increment_ratio = 0;
  // A partner refused this replica's own message as diverged: it takes a live replica's state.
  bool diverged = false;
  // The run's store did not answer: no group could meet, so this replica went alone.
  bool store_unreachable = false;
  // partner_wait: partners it left behind (alive, late past the wait), and
  // whether it came late itself and was left behind. Either way the late
  // replica's work stays in its weights, for its next meeting.
  std::vector<int> behind;
  double left_behind_by = 0;  // seconds it came late at least (0: it was not left behind)
  // pace=speed: what this replica's message said of its pace (its steps: its
  // increment's weight), and what its partners' said, by rank (where it was
  // left behind, what they noted at the meeting: it learns its pace there).
  std::optional<PaceReport> pace;
  std::map<int, PaceReport> partners_pace;
};

class OuterOptimizer {
 public:
  virtual ~OuterOptimizer() = default;
  // After backward, before clipping: DDP averages gradients here. True when
  // it synchronised (an outer step of its own, counted as one).
  virtual bool on_gradients(FlatParams&) { return false; }
  // After inner step `step` (0-based); reports the outer step when one ran.
  virtual std::optional<OuterSync> after_inner_step(int64_t /*step*/, FlatParams&) { return std::nullopt; }
  // After the last inner step: whatever is still in flight is applied and reported.
  virtual std::vector<OuterSync> finish(FlatParams&) { return {}; }
  // State that must survive a restart (slow weights, momentum, residuals).
  virtual void save(TensorMap&) const {}
  virtual void load(const TensorMap&) {}
  // pace=speed: which inner steps this replica takes (optim/pace.h); null: every one.
  virtual Pace* pace() { return nullptr; }
  // Whether this worker trains in slot `step`, asked once a slot, in order:
  // its pace's answer, or its replica's (replica_workers.h); else always.
  virtual bool trains_at(int64_t step) {
    Pace* const p = pace();
    return !p || p->trains_at(step);
  }
};

// Where a method's traffic goes: the transport among the replicas of this
// worker's stage, and (for NoLoCo) who of them is alive. Both may be null
// for method "none"; membership may be null where every replica always is.
// In a replica of several workers only its first has them, and `replica` is
// the replica's own group (replica_workers.h); null for a one-worker replica.
struct ReplicaPeers {
  Transport* transport = nullptr;
  Membership* membership = nullptr;
  Collectives* replica = nullptr;
};

std::unique_ptr<OuterOptimizer> make_outer_optimizer(const OuterConfig& config, uint64_t seed, ReplicaPeers links,
                                                     FlatParams& params);

}  // namespace noloco
