// Failure drills for tests and rehearsals (`inject_crash`): this worker is
// killed with SIGKILL just before a chosen inner step, or halfway through
// writing a chosen step's checkpoint, or frozen with SIGSTOP like a hung
// machine, or stalled for some seconds with its heartbeat on (a replica busy
// handing its state over, or paused, falls behind its partners), or killed
// or frozen before it joins the run (before its first heartbeat), or has one
// byte of its next outer message flipped on the wire, or its weights thrown
// off (a replica that blew up), or (a worker joining the
// running run) killed once a donor has claimed its hand-over. A restarted
// worker (a later incarnation) runs on.
#pragma once
#include <cstdint>
#include <string>

namespace noloco {

class FailureDrill {
 public:
  FailureDrill(const std::string& plan, int worker, int incarnation);
  // Before the worker connects to the run.
  void at_startup() const;
  void before_step(int64_t step) const;
  // Whether this worker's next outer message from `step` on is to be corrupted
  // (Transport::corrupt_next_message does it).
  bool corrupts_before(int64_t step) const { return step == corrupt_at_; }
  // Whether this worker's weights are to be thrown off before `step` (a replica that blew up).
  bool diverges_before(int64_t step) const { return step == diverge_at_; }
  // Called between the files of the checkpoint of `step`.
  void inside_checkpoint(int64_t step) const;
  // A joiner whose donor has claimed its request, before the state arrives.
  void during_handover() const;

 private:
  int64_t kill_at_ = -1, freeze_at_ = -1, stall_at_ = -1, kill_in_checkpoint_ = -1, corrupt_at_ = -1, diverge_at_ = -1;
  double stall_seconds_ = 0;
  bool kill_at_startup_ = false, freeze_at_startup_ = false, kill_in_handover_ = false;
};

}  // namespace noloco
