// What this process has cost so far, for summaries and benchmarks, and where it runs.
#pragma once
#include <string>

namespace noloco {

// The largest resident set this process has had, in MiB (file pages mapped
// and touched, such as a corpus's, included).
double peak_rss_mib();
// Seconds since this process started (its first exec, before noloco's
// re-execution with its runtime settings), to 1/100 s.
double seconds_since_process_start();
// Seconds since the epoch on this machine's clock.
double unix_seconds();
// This machine's host name ("localhost" if it has none).
std::string machine_name();

}  // namespace noloco
