#include "train/failure_drill.h"

#include <signal.h>

#include <chrono>
#include <thread>

#include "config/train_config.h"

namespace noloco {

FailureDrill::FailureDrill(const std::string& plan, int worker, int incarnation) {
  if (incarnation > 0) return;
  for (const auto& point : parse_crash_plan(plan)) {
    if (point.rank != worker) continue;
    switch (point.mode) {
      case CrashPoint::Mode::kill: kill_at_ = point.step; break;
      case CrashPoint::Mode::freeze: freeze_at_ = point.step; break;
      case CrashPoint::Mode::corrupt: corrupt_at_ = point.step; break;
      case CrashPoint::Mode::diverge: diverge_at_ = point.step; break;
      case CrashPoint::Mode::stall:
        stall_at_ = point.step;
        stall_seconds_ = point.stall_seconds;
        break;
      case CrashPoint::Mode::kill_in_checkpoint: kill_in_checkpoint_ = point.step; break;
      case CrashPoint::Mode::startup: kill_at_startup_ = true; break;
      case CrashPoint::Mode::freeze_at_startup: freeze_at_startup_ = true; break;
      case CrashPoint::Mode::handover: kill_in_handover_ = true; break;
    }
  }
}

void FailureDrill::at_startup() const {
  if (kill_at_startup_) ::raise(SIGKILL);
  if (freeze_at_startup_) ::raise(SIGSTOP);
}

void FailureDrill::before_step(int64_t step) const {
  if (step == kill_at_) ::raise(SIGKILL);
  if (step == freeze_at_) ::raise(SIGSTOP);
  if (step == stall_at_) std::this_thread::sleep_for(std::chrono::duration<double>(stall_seconds_));
}

void FailureDrill::inside_checkpoint(int64_t step) const {
  if (step == kill_in_checkpoint_) ::raise(SIGKILL);
}

void FailureDrill::during_handover() const {
  if (kill_in_handover_) ::raise(SIGKILL);
}

}  // namespace noloco
