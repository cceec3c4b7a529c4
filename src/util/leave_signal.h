// SIGTERM as a request to leave. A NoLoCo replica (unpipelined) can leave a
// run: nobody depends on it beyond the exchange in flight, so SIGTERM asks it
// to, at the end of its step. Every other worker keeps SIGTERM's default (a
// collective or a pipeline route needs it: it stops), and so does every
// worker until its first step: before it has trained it has nothing to hand
// back, and the waits of its start (the store, the run's config, a resume's
// step, a live replica's state: up to 10 minutes) would hold the request.
#pragma once

namespace noloco {

// From now on SIGTERM only sets the request (later calls change nothing).
void leave_on_sigterm();
// Whether a SIGTERM came since leave_on_sigterm().
bool leave_requested();

}  // namespace noloco
