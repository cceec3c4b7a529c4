#include "comm/transport/gloo_admission.h"

#include <dlfcn.h>
#include <fcntl.h>
#include <link.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <sodium.h>
#include <sys/eventfd.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace noloco {

namespace {

using Clock = std::chrono::steady_clock;

constexpr size_t kChallengeBytes = 16;
constexpr size_t kProofBytes = 32;
// A connection that has not proved the key by then is a stranger's.
constexpr auto kProofWindow = std::chrono::seconds(5);
// Strangers' connections held at once per listener; the oldest go first.
constexpr size_t kMostPending = 64;

// The kernel's calls, bypassing the interposed names below.
int sys_close(int fd) { return int(::syscall(SYS_close, fd)); }
int sys_listen(int fd, int backlog) { return int(::syscall(SYS_listen, fd, backlog)); }
int sys_connect(int fd, const sockaddr* a, socklen_t n) { return int(::syscall(SYS_connect, fd, a, n)); }
int sys_accept4(int fd, sockaddr* a, socklen_t* n, int flags) { return int(::syscall(SYS_accept4, fd, a, n, flags)); }
int sys_getsockname(int fd, sockaddr* a, socklen_t* n) { return int(::syscall(SYS_getsockname, fd, a, n)); }

struct Scope {
  AdmissionKey key;
  Clock::time_point deadline;
};
thread_local const Scope* scope = nullptr;

bool called_from_gloo(const void* return_address) {
  Dl_info info{};
  return ::dladdr(return_address, &info) != 0 && info.dli_fname && std::strstr(info.dli_fname, "libgloo");
}

// What the proof binds: the address the member connected to (so a proof
// cannot be carried to another port) and the listener's fresh challenge (so
// it cannot be replayed).
std::array<uint8_t, kProofBytes> proof(const AdmissionKey& key, const sockaddr* to, const uint8_t* challenge) {
  std::vector<uint8_t> message{'n', 'o', 'l', 'o', 'c', 'o', ' ', 'g', 'l', 'o', 'o', ' ', 'a', 'd', 'm', 'i', 't'};
  auto append = [&](const void* p, size_t n) {
    message.insert(message.end(), static_cast<const uint8_t*>(p), static_cast<const uint8_t*>(p) + n);
  };
  if (to->sa_family == AF_INET) {
    const auto* a = reinterpret_cast<const sockaddr_in*>(to);
    append(&a->sin_port, sizeof(a->sin_port));
    append(&a->sin_addr, sizeof(a->sin_addr));
  } else if (to->sa_family == AF_INET6) {
    const auto* a = reinterpret_cast<const sockaddr_in6*>(to);
    append(&a->sin6_port, sizeof(a->sin6_port));
    append(&a->sin6_addr, sizeof(a->sin6_addr));
  }
  append(challenge, kChallengeBytes);
  std::array<uint8_t, kProofBytes> mac{};
  crypto_generichash(mac.data(), mac.size(), message.data(), message.size(), key.data(), key.size());
  return mac;
}

// A listener Gloo believes it has: Gloo holds `gloo_fd` (an eventfd now),
// the side thread the TCP socket.
struct Listener {
  int gloo_fd = -1;
  int tcp_fd = -1;
  AdmissionKey key{};
  sockaddr_storage address{};
  socklen_t address_length = 0;
  struct Pending {
    int fd;
    Clock::time_point until;
    std::array<uint8_t, kChallengeBytes> challenge;
    std::array<uint8_t, kProofBytes> answer;
    size_t received;
  };
  std::deque<Pending> pending;
  int admitted = -1;  // a member's connection, for Gloo's accept()
  bool closed = false;
};

class Gatekeeper {
 public:
  static Gatekeeper& get() {
    static auto* keeper = new Gatekeeper;  // never destroyed: its thread outlives main
    return *keeper;
  }

  bool any() const { return count_.load(std::memory_order_acquire) > 0; }

  // Moves Gloo's socket `fd` aside (see the header). False leaves it as it was.
  bool take(int fd, int backlog, const AdmissionKey& key) {
    auto listener = std::make_shared<Listener>();
    listener->gloo_fd = fd;
    listener->key = key;
    listener->address_length = sizeof(listener->address);
    listener->tcp_fd = ::fcntl(fd, F_DUPFD_CLOEXEC, 0);
    if (listener->tcp_fd < 0) return false;
    const int signal = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (sys_listen(listener->tcp_fd, std::max(backlog, 128)) != 0 || signal < 0 ||
        sys_getsockname(listener->tcp_fd, reinterpret_cast<sockaddr*>(&listener->address),
                        &listener->address_length) != 0 ||
        ::fcntl(listener->tcp_fd, F_SETFL, ::fcntl(listener->tcp_fd, F_GETFL) | O_NONBLOCK) != 0) {
      if (signal >= 0) sys_close(signal);
      sys_close(listener->tcp_fd);
      return false;
    }
    std::lock_guard<std::mutex> lock(mutex_);
    ::dup2(signal, fd);
    sys_close(signal);
    listeners_[fd] = listener;
    count_.fetch_add(1, std::memory_order_release);
    start_locked();
    wake();
    return true;
  }

  // Gloo's accept() on a listener it believes it has: the member's connection.
  bool accept(int fd, sockaddr* address, socklen_t* length, int* result) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = listeners_.find(fd);
    if (it == listeners_.end()) return false;
    uint64_t signalled;
    (void)!::read(fd, &signalled, sizeof(signalled));
    auto& l = *it->second;
    if (l.admitted < 0) {
      errno = EAGAIN;
      *result = -1;
      return true;
    }
    *result = l.admitted;
    l.admitted = -1;
    if (address && length) ::getpeername(*result, address, length);
    return true;
  }

  bool sockname(int fd, sockaddr* address, socklen_t* length, int* result) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = listeners_.find(fd);
    if (it == listeners_.end()) return false;
    const auto& l = *it->second;
    std::memcpy(address, &l.address, std::min(*length, l.address_length));
    *length = l.address_length;
    *result = 0;
    return true;
  }

  // Gloo closes a listener: the side thread closes what is behind it.
  void forget(int fd) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = listeners_.find(fd);
    if (it == listeners_.end()) return;
    it->second->closed = true;
    closed_.push_back(it->second);
    listeners_.erase(it);
    count_.fetch_sub(1, std::memory_order_release);
    wake();
  }

 private:
  Gatekeeper() = default;

  void wake() { (void)!::eventfd_write(wake_fd_, 1); }

  void start_locked() {
    if (wake_fd_ >= 0) return;
    wake_fd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    std::thread([this] { serve(); }).detach();
    // A child (before its exec) has no side thread and may have been forked
    // while it held the lock: its close() must not look at the listeners.
    ::pthread_atfork(nullptr, nullptr, [] { get().count_.store(0); });
  }

  static void drop(Listener& l) {
    sys_close(l.tcp_fd);
    l.tcp_fd = -1;
    for (auto& p : l.pending) sys_close(p.fd);
    l.pending.clear();
  }

  void serve() {
    for (;;) {
      std::vector<pollfd> polled{{wake_fd_, POLLIN, 0}};
      std::vector<std::pair<std::shared_ptr<Listener>, int>> owners{{nullptr, -1}};  // -1: the listener itself
      auto next = Clock::now() + std::chrono::seconds(1);
      {
        std::lock_guard<std::mutex> lock(mutex_);
        for (auto& l : closed_) {
          drop(*l);
          if (l->admitted >= 0) sys_close(l->admitted);
          l->admitted = -1;
        }
        closed_.clear();
        for (auto& [fd, l] : listeners_) {
          if (l->tcp_fd < 0) continue;
          polled.push_back({l->tcp_fd, POLLIN, 0});
          owners.emplace_back(l, -1);
          for (size_t i = 0; i < l->pending.size(); ++i) {
            polled.push_back({l->pending[i].fd, POLLIN, 0});
            owners.emplace_back(l, int(i));
            next = std::min(next, l->pending[i].until);
          }
        }
      }
      const auto wait = std::chrono::duration_cast<std::chrono::milliseconds>(next - Clock::now()).count();
      ::poll(polled.data(), polled.size(), int(std::max<int64_t>(0, wait) + 1));
      std::lock_guard<std::mutex> lock(mutex_);
      eventfd_t ignored;
      (void)::eventfd_read(wake_fd_, &ignored);
      // Pending connections first (by index, before accepting adds more).
      for (size_t k = polled.size(); k-- > 1;) {
        auto& [l, index] = owners[k];
        if (index < 0 || l->closed || l->tcp_fd < 0 || !polled[k].revents) continue;
        read_proof(*l, size_t(index));
      }
      for (size_t k = 1; k < polled.size(); ++k) {
        auto& [l, index] = owners[k];
        if (index >= 0 || l->closed || l->tcp_fd < 0 || !polled[k].revents) continue;
        accept_all(*l);
      }
      const auto now = Clock::now();
      for (auto& [fd, l] : listeners_) {
        auto& p = l->pending;
        for (auto& c : p)
          if (c.until <= now || c.fd < 0) {
            if (c.fd >= 0) sys_close(c.fd);
            c.fd = -1;
          }
        p.erase(std::remove_if(p.begin(), p.end(), [](const Listener::Pending& c) { return c.fd < 0; }), p.end());
      }
    }
  }

  void accept_all(Listener& l) {
    for (;;) {
      const int fd = sys_accept4(l.tcp_fd, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0) return;
      Listener::Pending p{fd, Clock::now() + kProofWindow, {}, {}, 0};
      randombytes_buf(p.challenge.data(), p.challenge.size());
      if (::send(fd, p.challenge.data(), p.challenge.size(), MSG_NOSIGNAL) != ssize_t(p.challenge.size())) {
        sys_close(fd);
        continue;
      }
      if (l.pending.size() >= kMostPending) {
        sys_close(l.pending.front().fd);
        l.pending.pop_front();
      }
      l.pending.push_back(p);
    }
  }

  void read_proof(Listener& l, size_t index) {
    auto& p = l.pending[index];
    if (p.fd < 0) return;
    const auto n = ::recv(p.fd, p.answer.data() + p.received, kProofBytes - p.received, 0);
    if (n <= 0) {
      if (n == 0 || (errno != EAGAIN && errno != EWOULDBLOCK)) {
        sys_close(p.fd);
        p.fd = -1;
      }
      return;
    }
    p.received += size_t(n);
    if (p.received < kProofBytes) return;
    sockaddr_storage local{};
    socklen_t length = sizeof(local);
    const bool genuine = sys_getsockname(p.fd, reinterpret_cast<sockaddr*>(&local), &length) == 0 &&
                         sodium_memcmp(proof(l.key, reinterpret_cast<sockaddr*>(&local), p.challenge.data()).data(),
                                       p.answer.data(), kProofBytes) == 0;
    if (!genuine) {
      sys_close(p.fd);
      p.fd = -1;
      return;
    }
    // A pair takes one connection: the port closes now, as Gloo's would.
    l.admitted = p.fd;
    p.fd = -1;
    drop(l);
    (void)!::eventfd_write(l.gloo_fd, 1);
  }

  std::mutex mutex_;
  std::atomic<int> count_{0};
  std::map<int, std::shared_ptr<Listener>> listeners_;  // by Gloo's descriptor
  std::vector<std::shared_ptr<Listener>> closed_;
  int wake_fd_ = -1;
};

bool wait_for(int fd, short events, Clock::time_point deadline) {
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
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

// The member's half, on a connecting socket (blocking or not): waits for the
// connection and the challenge, sends the proof. 0, or -1 with errno set.
int prove(int fd, const sockaddr* to, const AdmissionKey& key, Clock::time_point deadline) {
  if (!wait_for(fd, POLLOUT, deadline)) return -1;
  int error = 0;
  socklen_t length = sizeof(error);
  if (::getsockopt(fd, SOL_SOCKET, SO_ERROR, &error, &length) != 0) return -1;
  if (error != 0) {
    errno = error;
    return -1;
  }
  std::array<uint8_t, kChallengeBytes> challenge{};
  for (size_t got = 0; got < challenge.size();) {
    if (!wait_for(fd, POLLIN, deadline)) return -1;
    const auto n = ::recv(fd, challenge.data() + got, challenge.size() - got, MSG_DONTWAIT);
    if (n == 0) {
      errno = ECONNRESET;
      return -1;
    }
    if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) return -1;
    if (n > 0) got += size_t(n);
  }
  const auto mac = proof(key, to, challenge.data());
  if (::send(fd, mac.data(), mac.size(), MSG_NOSIGNAL | MSG_DONTWAIT) != ssize_t(mac.size())) return -1;
  return 0;
}

}  // namespace

Admission::Admission(const AdmissionKey& key, Clock::time_point deadline) : outer_(scope) {
  scope = new Scope{key, deadline};
}
Admission::~Admission() {
  delete scope;
  scope = static_cast<const Scope*>(outer_);
}

void knock(const sockaddr_storage& address, const AdmissionKey* key) {
  const socklen_t length = address.ss_family == AF_INET    ? sizeof(sockaddr_in)
                           : address.ss_family == AF_INET6 ? sizeof(sockaddr_in6)
                                                           : 0;
  if (length == 0) return;
  const int fd = ::socket(address.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) return;
  const auto* to = reinterpret_cast<const sockaddr*>(&address);
  const auto deadline = Clock::now() + std::chrono::seconds(1);
  if (sys_connect(fd, to, length) == 0 || errno == EINPROGRESS) {
    if (key)
      (void)prove(fd, to, *key, deadline);
    else
      (void)wait_for(fd, POLLOUT, deadline);
  }
  sys_close(fd);
}

bool admission_available() {
  // Only where the process's listen() is ours: an executable exports it (the
  // dynamic list); in a module loaded into Python, libgloo binds to libc's.
  Dl_info resolved{}, ours{};
  void* listen_symbol = ::dlsym(RTLD_DEFAULT, "listen");
  if (!listen_symbol || ::dladdr(listen_symbol, &resolved) == 0 ||
      ::dladdr(reinterpret_cast<void*>(&admission_available), &ours) == 0 || resolved.dli_fbase != ours.dli_fbase)
    return false;
  return ::dl_iterate_phdr(
             [](dl_phdr_info* info, size_t, void*) {
               return int(info->dlpi_name && std::strstr(info->dlpi_name, "libgloo") != nullptr);
             },
             nullptr) != 0;
}

}  // namespace noloco

// The interposed calls (see the header). Each does exactly what the kernel
// does unless admission applies.
using noloco::Gatekeeper;

extern "C" {

int listen(int fd, int backlog) {
  if (noloco::scope && noloco::called_from_gloo(__builtin_return_address(0)) &&
      Gatekeeper::get().take(fd, backlog, noloco::scope->key))
    return 0;
  return noloco::sys_listen(fd, backlog);
}

int accept(int fd, sockaddr* address, socklen_t* length) {
  int result;
  if (Gatekeeper::get().any() && Gatekeeper::get().accept(fd, address, length, &result)) return result;
  return noloco::sys_accept4(fd, address, length, 0);
}

int getsockname(int fd, sockaddr* address, socklen_t* length) {
  int result;
  if (Gatekeeper::get().any() && Gatekeeper::get().sockname(fd, address, length, &result)) return result;
  return noloco::sys_getsockname(fd, address, length);
}

int connect(int fd, const sockaddr* address, socklen_t length) {
  const int rv = noloco::sys_connect(fd, address, length);
  if (!noloco::scope || !noloco::called_from_gloo(__builtin_return_address(0)) || (rv != 0 && errno != EINPROGRESS) ||
      (address->sa_family != AF_INET && address->sa_family != AF_INET6))
    return rv;
  return noloco::prove(fd, address, noloco::scope->key, noloco::scope->deadline);
}

int close(int fd) {
  if (Gatekeeper::get().any()) Gatekeeper::get().forget(fd);
  return noloco::sys_close(fd);
}

}  // extern "C"
