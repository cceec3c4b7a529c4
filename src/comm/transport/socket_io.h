// Bounded waits on sockets, for the hand-shakes in front of Gloo (admission,
// the relay): each returns false with errno set (ETIMEDOUT at `deadline`).
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

}  // namespace noloco
