#include "comm/link/socket_io.h"

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>

namespace noloco {

bool wait_for(int fd, short events, std::chrono::steady_clock::time_point deadline) {
  for (;;) {
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now()).count();
    if (left <= 0) {
      errno = ETIMEDOUT;
      return false;
    }
    pollfd p{fd, events, 0};
    const int n = ::poll(&p, 1, int(std::min<int64_t>(left, 1 << 30)));
    if (n > 0) return true;
    if (n < 0 && errno != EINTR) return false;
  }
}

bool wait_connected(int fd, std::chrono::steady_clock::time_point deadline) {
  if (!wait_for(fd, POLLOUT, deadline)) return false;
  int error = 0;
  socklen_t length = sizeof(error);
  if (::getsockopt(fd, SOL_SOCKET, SO_ERROR, &error, &length) != 0) return false;
  if (error != 0) {
    errno = error;
    return false;
  }
  return true;
}

bool read_exactly(int fd, uint8_t* out, size_t n, std::chrono::steady_clock::time_point deadline) {
  for (size_t got = 0; got < n;) {
    if (!wait_for(fd, POLLIN, deadline)) return false;
    const auto r = ::recv(fd, out + got, n - got, MSG_DONTWAIT);
    if (r == 0) {
      errno = ECONNRESET;
      return false;
    }
    if (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) return false;
    if (r > 0) got += size_t(r);
  }
  return true;
}

bool write_exactly(int fd, const uint8_t* data, size_t n, std::chrono::steady_clock::time_point deadline) {
  for (size_t put = 0; put < n;) {
    const auto w = ::send(fd, data + put, n - put, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (w > 0) {
      put += size_t(w);
      continue;
    }
    if (w < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) return false;
    if (!wait_for(fd, POLLOUT, deadline)) return false;
  }
  return true;
}

void set_nodelay(int fd) {
  const int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

int tcp_socket() {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  static const char kCubic[] = "cubic";
  if (fd >= 0) ::setsockopt(fd, IPPROTO_TCP, TCP_CONGESTION, kCubic, sizeof(kCubic) - 1);  // else the default stays
  return fd;
}

bool local_network_address(uint32_t ipv4) {
  const auto in = [ipv4](uint32_t network, int bits) { return (ipv4 >> (32 - bits)) == (network >> (32 - bits)); };
  return in(0x7f000000, 8) || in(0x0a000000, 8) || in(0xac100000, 12) || in(0xc0a80000, 16) || in(0xa9fe0000, 16);
}

bool peer_on_local_network(int fd) {
  sockaddr_storage a{};
  socklen_t n = sizeof(a);
  if (::getpeername(fd, reinterpret_cast<sockaddr*>(&a), &n) != 0 || a.ss_family != AF_INET) return false;
  return local_network_address(ntohl(reinterpret_cast<const sockaddr_in&>(a).sin_addr.s_addr));
}

}  // namespace noloco
