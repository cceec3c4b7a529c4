// SIGTERM as a request to leave. A NoLoCo replica (unpipelined) can leave a
// run: nobody depends on it beyond the exchange in flight, so SIGTERM asks it
// to, at the end of its step. Every other worker keeps SIGTERM's default (a
// collective or a pipeline route needs it: it stops).
#pragma once

namespace noloco {

// From now on SIGTERM only sets the request.
void leave_on_sigterm();
// Whether a SIGTERM came since leave_on_sigterm().
bool leave_requested();

}  // namespace noloco
