#include "comm/link/socket_io.h"

#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <stdexcept>

#include <fmt/format.h>

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

sockaddr_storage resolve_ipv4(const std::string& host, int port, const std::string& named_by) {
  addrinfo hints{}, *found = nullptr;
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  if (::getaddrinfo(host.c_str(), nullptr, &hints, &found) != 0 || !found)
    throw std::invalid_argument(fmt::format("{}: no IPv4 address for {}", named_by, host));
  sockaddr_storage address{};
  std::memcpy(&address, found->ai_addr, found->ai_addrlen);
  ::freeaddrinfo(found);
  reinterpret_cast<sockaddr_in*>(&address)->sin_port = htons(uint16_t(port));
  return address;
}

int listen_socket(const std::string& bind, int port, int backlog, const std::string& who) {
  const auto at = resolve_ipv4(bind, port, who + ": bind");
  const int fd = tcp_socket();
  const int one = 1;
  if (fd >= 0) ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (fd < 0 || ::bind(fd, reinterpret_cast<const sockaddr*>(&at), sizeof(sockaddr_in)) != 0 ||
      ::listen(fd, backlog) != 0) {
    const auto why = std::strerror(errno);
    if (fd >= 0) ::close(fd);
    throw std::runtime_error(fmt::format("{}: cannot listen on {}:{}: {}", who, bind, port, why));
  }
  return fd;
}

int local_port(int fd) {
  sockaddr_storage a{};
  socklen_t n = sizeof(a);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &n);
  return ntohs(reinterpret_cast<sockaddr_in&>(a).sin_port);
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
