// Rejoin: a restarted worker takes its training state from a live replica
// of its group instead of a checkpoint; live replicas serve such requests
// after their outer steps. Membership decides who serves whom; the bytes go
// by the transport, with a checked header.
#pragma once
#include <chrono>
#include <vector>

#include "comm/membership/membership.h"
#include "comm/transport/transport.h"
#include "config/train_config.h"
#include "train/failure_drill.h"
#include "train/training_state.h"

namespace noloco {

struct Rejoined {
  int64_t step = 0;  // inner steps the donor had done
  int donor = 0;
  double seconds = 0;
  bool joined = false;  // a new member of the run, not a restarted one
};

// How long a restarted or joining replica waits for its donor, which serves
// it at its next outer step: peer_timeout, but at least ten minutes.
std::chrono::milliseconds rejoin_timeout(const CommConfig& comm);
// A restarted worker (membership.incarnation() > 0) or a joiner
// (membership.joining()): waits for a donor, takes its state.
Rejoined rejoin_from_peer(Membership& membership, Transport& transport, const TrainingState& state,
                          std::chrono::milliseconds timeout, const FailureDrill& drill);
// A replica of several workers, restarted or joining: its first worker,
// which took a live replica's state (`step` its inner steps), hands it to the
// others over the replica's own group; each returns that step.
int64_t share_state_within_replica(Collectives& replica, const TrainingState& state, int64_t step);
// The requests a live replica won: those it handed its state to, and those
// whose receiver was gone before it had the state (declared dead).
struct HandOvers {
  std::vector<int> served, abandoned;
};
// A live replica after an outer step at inner step `step`: hands its state to
// the restarted replicas whose request it won.
HandOvers serve_rejoins(Membership& membership, Transport& transport, const TrainingState& state, int64_t step);

}  // namespace noloco
