// The sockets of links and the relay: made, listening, and bounded waits on
// them for links and their hand-shakes, the relay and admission (each wait
// returns false with errno set, ETIMEDOUT at `deadline`).
#pragma once
#include <sys/socket.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>

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
// A non-blocking TCP socket for a link, a relay or a listener of either,
// under CUBIC where the kernel lets this process choose it, whatever the
// kernel's default. Two homes sending to each other at once both fill FIFO
// uplink queues, so each direction's acknowledgements wait behind the
// other's data; BBR (some kernels' default) then misreads its round trip and
// left the uplinks idle: 10 MB each way over 20 Mbit/s took up to 1.71x the
// links' limit (scripts/link_check.sh). The choice is made before the socket
// connects (accepted connections inherit their listener's): a connection
// established under BBR keeps BBR's pacing after a switch to CUBIC, paced
// from the round trip its last exchange saw through full queues, so after an
// idle pause it restarted at a few hundred kB/s for a third of a second.
int tcp_socket();
// `host`'s IPv4 address with `port`; throws std::invalid_argument starting
// with `named_by` when it has none.
sockaddr_storage resolve_ipv4(const std::string& host, int port, const std::string& named_by);
// The one TCP listener (links, relays, the live page): a tcp_socket() (its connections
// inherit its CUBIC) bound to `bind`:`port` (0: the kernel picks) and
// listening. Throws std::runtime_error "WHO: cannot listen on BIND:PORT: WHY".
int listen_socket(const std::string& bind, int port, int backlog, const std::string& who);
// The port a bound socket holds.
int local_port(int fd);
// Whether an IPv4 address (host byte order) is on a local network: loopback,
// a private range (RFC 1918) or link-local. Traffic to one stays off the
// internet uplink; carrier-grade NAT's 100.64/10 does not.
bool local_network_address(uint32_t ipv4);
// Whether connected `fd`'s far end is at such an address.
bool peer_on_local_network(int fd);

}  // namespace noloco
