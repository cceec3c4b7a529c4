// A store whose blocking calls stop as soon as the caller has a reason to
// stop waiting: forming a process group with a member that is meanwhile
// given up (declared dead, heartbeat silent) would otherwise wait out the
// whole peer_timeout in the rendezvous.
#pragma once
#include <functional>

#include "comm/store/store.h"

namespace noloco {

// `inner`, with get() and wait() waiting in slices of `slice` and throwing
// std::runtime_error once `abandon` returns true (asked before each, even
// when the keys are there); their overall bound is still `inner`'s timeout.
// Everything else goes straight to `inner`.
StorePtr abandonable(StorePtr inner, std::function<bool()> abandon,
                     std::chrono::milliseconds slice = std::chrono::milliseconds(200));

}  // namespace noloco
