// SIGTERM and SIGINT as the end of a process that serves until told (`noloco
// serve`, `noloco watch`). A handler hands the signal to the main thread
// through a pipe. Blocked and taken with sigwait() they raced with threads
// that never blocked them (started when libraries load): `timeout` sends a
// second SIGTERM to its process group, and about one stop in ten killed serve
// before it logged what its relay carried.
#pragma once
#include <chrono>

namespace noloco {

// Installs the handler; once, first thing.
void stop_on_signal();
// Blocks until SIGTERM or SIGINT; returns which.
int wait_for_stop();
// The same for at most `at_most`: 0 if none came by then.
int wait_for_stop(std::chrono::milliseconds at_most);
// Whether one has come (for waits before serving).
bool stop_signalled();

}  // namespace noloco
