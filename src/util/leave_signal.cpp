#include "util/leave_signal.h"

#include <signal.h>

#include <atomic>

namespace noloco {

namespace {

std::atomic<bool> requested{false}, installed{false};

}  // namespace

void leave_on_sigterm() {
  if (installed.exchange(true)) return;
  struct sigaction sa {};
  sa.sa_handler = [](int) { requested = true; };
  ::sigemptyset(&sa.sa_mask);
  ::sigaction(SIGTERM, &sa, nullptr);
}

bool leave_requested() { return requested.load(); }

}  // namespace noloco
