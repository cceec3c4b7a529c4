// pace=speed: every replica trains at its own speed between two outer steps.
//
// The run's clock stays its step count (slots): outer steps every H slots,
// evaluations, checkpoints, the learning-rate schedule and the end of the run
// all count slots, the same on every replica. A replica trains in every slot
// only if it is the fastest; one k times slower trains in about H/k of the H
// slots of a period, spread evenly, and passes the others, so all arrive at
// the outer step together and nobody waits for it. A slot holds at most one
// step because each slot has one batch a replica (the data is indexed by slot).
//
// Each replica measures its own step time; the reference is the fastest step
// time it has heard of lately: partners' step times and the fastest they
// heard of travel with every outer-step message (gossip, no store needed), and
// one not heard again within kReferenceHorizon outer steps ages out (a fast
// replica that left no longer sets the pace). The merge weighs each replica's
// increment by the steps behind it (PaceReport::steps; docs/method.md).
#pragma once
#include <cstdint>
#include <deque>
#include <map>
#include <string>
#include <vector>

#include "optim/pace_share.h"
#include "util/tensor_map.h"

namespace noloco {

// What a replica's outer-step message says of its pace.
struct PaceReport {
  int64_t steps = 0;         // inner steps it trained in the last H slots: its increment's weight
  double step_seconds = 0;   // its own measured step time (0: not measured yet)
  int64_t reference_rank = -1;  // the fastest replica it heard of lately (-1: none)
  double reference_seconds = 0;
  int64_t reference_heard_at = 0;  // the outer step at which that replica said so itself

  static constexpr int64_t kBytes = 5 * 8;
  std::vector<uint8_t> to_bytes() const;
  // Throws std::runtime_error on a wrong size or values out of range (a stranger's bytes).
  static PaceReport from_bytes(const uint8_t* bytes, int64_t size);
};

class Pace {
 public:
  Pace(int64_t interval, int rank);

  // Whether this replica trains in slot `step` (0-based); asked once per
  // slot, in order. At the start of each period it sets the share of slots
  // it trains: reference / own step time, in [1/H, 1]; 1 while its step time
  // is within 10% of the reference. A credit carried from slot to slot
  // spreads them evenly and keeps the fraction over periods (a share of 0.3
  // of 10 slots trains 3, 3, 3, then 4).
  bool trains_at(int64_t step);
  // A trained step took `seconds` (compute only, outer steps not counted).
  void step_took(double seconds);
  // The report its message at outer step `outer_step` carries.
  PaceReport report(int64_t outer_step) const;
  // What partner `rank` reported at outer step `outer_step`.
  void hear(int rank, const PaceReport& report, int64_t outer_step);
  // Left behind at an outer step (partner_wait): it came at least `seconds`
  // after its partners, and skips that much of its next slots (at least
  // one, less than a period) to meet them in step again; left behind again,
  // it skips again.
  void fell_behind(double seconds);
  // A resume replays what its run did after the checkpoint: slots `from`,
  // `from` + 1, ... are answered as `slots` says (train/pace_record.h), the
  // rest as measured. Measured step times would not choose the same slots
  // again, and a partner's merge weighs the steps behind each increment.
  void replay(int64_t from, std::vector<bool> slots);

  // The steps this period takes at its share (rounded).
  int64_t period_steps() const;
  // Inner steps trained since the run began (a resume included).
  int64_t trained_steps() const { return trained_steps_; }
  double step_seconds() const { return step_seconds_; }
  // The reference step time: the fastest heard of lately, this replica included.
  double reference_seconds() const;

  void save(TensorMap& out) const;
  void load(const TensorMap& in);

  static constexpr int64_t kReferenceHorizon = 8;

 private:
  struct Heard {
    double seconds = 0;
    int64_t at = 0;
  };
  std::map<int, Heard>::const_iterator fastest() const;

  int64_t interval_;
  int rank_;
  double share_ = 1;   // of the slots, this period
  double credit_ = 0;  // steps owed, carried from slot to slot
  int64_t catching_up_ = 0;  // slots to skip, having been left behind
  int64_t replay_from_ = 0;
  std::vector<bool> replay_;  // slots replay_from_ on, as the run recorded them
  double step_seconds_ = 0;
  int64_t trained_steps_ = 0;
  int64_t latest_outer_step_ = 0;
  std::map<int, Heard> heard_;  // by rank: the latest step time each said of itself, or was said of it
  std::deque<bool> window_;     // the last H slots: trained or not
};

// Whether a state tensor is a machine's own pace, which its checkpoints keep
// and a hand-over to another machine leaves out (its speed is not the donor's).
bool is_pace_state(const std::string& name);

}  // namespace noloco
