// What this process asked of the run's store: its requests and the bytes of
// the answers, those of threads that ask on a clock (heartbeats, the live
// page's status) apart, so that what training itself asks (meetings,
// snapshots, hand-overs, liveness while waiting) can be read per outer step
// and compared across run sizes: a swarm's wall time per step grows with
// its size on one machine, and with it whatever is asked once a second.
#pragma once
#include <cstdint>

namespace noloco {

struct StoreTraffic {
  uint64_t requests = 0, bytes_read = 0;
};

// One request answered with `bytes_read` bytes (counted by the store's client).
void count_store_request(uint64_t bytes_read);
// This process's requests so far, the clocked threads' left out.
StoreTraffic store_traffic();
// From now on this thread's requests are on a clock: not in store_traffic().
void count_this_thread_as_clocked();

}  // namespace noloco
