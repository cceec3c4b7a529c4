// Bounded waits on sockets, for links and their hand-shakes, the relay and
// admission: each returns false with errno set (ETIMEDOUT at `deadline`).
#pragma once
#include <chrono>
#include <cstddef>
#include <cstdint>

namespace noloco {

// Until `fd` polls ready for `events`.
bool wait_for(int fd, short events, std::chrono::steady_clock::time_point deadline);
// Until the connect() begun on the non-blocking `fd` completes; errno is its error.
bool wait_connected(int fd, std::chrono::steady_clock::time_point deadline);
// Exactly `n` bytes from `fd` (blocking or not); EOF is ECONNRESET.
bool read_exactly(int fd, uint8_t* out, size_t n, std::chrono::steady_clock::time_point deadline);
// All `n` bytes to `fd` (blocking or not).
bool write_exactly(int fd, const uint8_t* data, size_t n, std::chrono::steady_clock::time_point deadline);
// Small messages leave at once (no Nagle delay).
void set_nodelay(int fd);
// A link's connection under CUBIC where the kernel has it, whatever its
// default. Two homes sending to each other at once both fill FIFO uplink
// queues, so each direction's acknowledgements wait behind the other's
// data; BBR (some kernels' default) then misreads its round trip and left
// the uplinks idle: 10 MB each way over 20 Mbit/s took up to 1.71x the
// links' limit under BBR and 1.14x under CUBIC (scripts/link_check.sh).
void prefer_cubic(int fd);

}  // namespace noloco
