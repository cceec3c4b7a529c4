#include "comm/transport/gloo_admission.h"
#include "comm/link/socket_io.h"

#include <dlfcn.h>
#include <fcntl.h>
#include <link.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <sodium.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <arpa/inet.h>
#include <netinet/tcp.h>
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
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

namespace noloco {

namespace {

using Clock = std::chrono::steady_clock;

constexpr size_t kChallengeBytes = 16;
constexpr size_t kProofBytes = 32;
// A connection that has not proved the key by then is a stranger's.
constexpr auto kProofWindow = std::chrono::seconds(5);
// Strangers' connections held at once per listener, and at the door (every
// member's connections arrive there); the oldest go first.
constexpr size_t kMostPending = 64;
constexpr size_t kMostAtDoor = 1024;
// Sent by the listener once a proof checks out: the member's connect()
// returns only then, so a connection that reached the wrong listener (two
// homes on the same LAN address) is told apart and goes through a relay.
constexpr uint8_t kAdmitted = 'A';
// With relays, a direct connection gets this long before the relay is asked;
// an address that could not be reached is relayed at once for a while.
constexpr auto kDirectWait = std::chrono::seconds(2);
constexpr auto kUnreachableFor = std::chrono::minutes(1);
// A listener's park at a relay (connection and proof) must take no longer.
constexpr auto kParkSetUp = std::chrono::seconds(5);

// The kernel's calls, bypassing the interposed names below.
int sys_close(int fd) { return int(::syscall(SYS_close, fd)); }
int sys_listen(int fd, int backlog) { return int(::syscall(SYS_listen, fd, backlog)); }
int sys_connect(int fd, const sockaddr* a, socklen_t n) { return int(::syscall(SYS_connect, fd, a, n)); }
int sys_accept4(int fd, sockaddr* a, socklen_t* n, int flags) { return int(::syscall(SYS_accept4, fd, a, n, flags)); }
int sys_getsockname(int fd, sockaddr* a, socklen_t* n) { return int(::syscall(SYS_getsockname, fd, a, n)); }

struct Scope {
  AdmissionKey key;
  Clock::time_point deadline;
  uint64_t id;  // never reused, unlike the Scope's address
};
std::atomic<uint64_t> scopes_made{0};
thread_local const Scope* scope = nullptr;

struct Relays {
  std::vector<sockaddr_storage> at;
  RelayKey key{};
};
// Never destroyed: the relay watch's thread reads them until the process ends.
std::mutex& relays_mutex = *new std::mutex;
std::shared_ptr<const Relays>& configured_relays = *new std::shared_ptr<const Relays>;

std::shared_ptr<const Relays> relays() {
  std::lock_guard<std::mutex> lock(relays_mutex);
  return configured_relays;
}

std::string address_text(const sockaddr* address) {
  char text[INET6_ADDRSTRLEN] = {};
  if (address->sa_family == AF_INET) {
    const auto* a = reinterpret_cast<const sockaddr_in*>(address);
    ::inet_ntop(AF_INET, &a->sin_addr, text, sizeof(text));
    return std::string(text) + ":" + std::to_string(ntohs(a->sin_port));
  }
  const auto* a = reinterpret_cast<const sockaddr_in6*>(address);
  ::inet_ntop(AF_INET6, &a->sin6_addr, text, sizeof(text));
  return "[" + std::string(text) + "]:" + std::to_string(ntohs(a->sin6_port));
}

// The relay `fd` is connected to (a spliced connection's other end), if it is one of those in use.
std::optional<std::string> relay_of(int fd, const Relays& relays) {
  sockaddr_storage peer{};
  socklen_t length = sizeof(peer);
  if (::getpeername(fd, reinterpret_cast<sockaddr*>(&peer), &length) != 0 || peer.ss_family != AF_INET)
    return std::nullopt;
  const auto& p = reinterpret_cast<const sockaddr_in&>(peer);
  for (const auto& at : relays.at) {
    if (at.ss_family != AF_INET) continue;
    const auto& r = reinterpret_cast<const sockaddr_in&>(at);
    if (r.sin_addr.s_addr == p.sin_addr.s_addr && r.sin_port == p.sin_port)
      return address_text(reinterpret_cast<const sockaddr*>(&at));
  }
  return std::nullopt;
}

// IPv4 hosts a direct connection did not reach lately: relayed at once.
class Unreachable {
 public:
  bool now(const sockaddr* to) {
    std::lock_guard<std::mutex> lock(mutex_);
    const auto it = until_.find(host(to));
    return it != until_.end() && it->second > Clock::now();
  }
  void mark(const sockaddr* to) {
    std::lock_guard<std::mutex> lock(mutex_);
    until_[host(to)] = Clock::now() + kUnreachableFor;
  }

 private:
  static uint32_t host(const sockaddr* to) {
    return to->sa_family == AF_INET ? reinterpret_cast<const sockaddr_in*>(to)->sin_addr.s_addr : 0;
  }
  std::mutex mutex_;
  std::map<uint32_t, Clock::time_point> until_;
};
Unreachable unreachable;

// Whether the file a loaded object came from is Gloo's library.
bool is_gloo(const char* file) { return file && std::strstr(file, "libgloo") != nullptr; }

bool called_from_gloo(const void* return_address) {
  Dl_info info{};
  return ::dladdr(return_address, &info) != 0 && is_gloo(info.dli_fname);
}

// What the proof binds: the address the member connected to, listener id
// included (so a proof cannot be carried to another listener), and the
// listener's fresh challenge (so it cannot be replayed).
std::array<uint8_t, kProofBytes> proof(const AdmissionKey& key, const sockaddr* to, const uint8_t* challenge) {
  std::vector<uint8_t> message{'n', 'o', 'l', 'o', 'c', 'o', ' ', 'g', 'l', 'o', 'o', ' ', 'a', 'd', 'm', 'i', 't'};
  auto append = [&](const void* p, size_t n) {
    message.insert(message.end(), static_cast<const uint8_t*>(p), static_cast<const uint8_t*>(p) + n);
  };
  if (to->sa_family == AF_INET) {
    const auto* a = reinterpret_cast<const sockaddr_in*>(to);
    append(&a->sin_port, sizeof(a->sin_port));
    append(&a->sin_addr, sizeof(a->sin_addr));
    append(a->sin_zero, sizeof(a->sin_zero));
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

// A TCP connection whose other end is already closed. Gloo 1.13 cannot take
// a failed connect(): it tears the pair down through a descriptor it already
// closed and aborts the process (epoll_ctl: Bad file descriptor). Given this
// instead, it reads "connection closed by peer", and the group forms again.
int closed_connection() {
  const int listener = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t length = sizeof(address);
  int fd = -1;
  if (listener >= 0 && ::bind(listener, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0 &&
      sys_listen(listener, 1) == 0 &&
      sys_getsockname(listener, reinterpret_cast<sockaddr*>(&address), &length) == 0) {
    fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd >= 0 && sys_connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0) {
      const int accepted = sys_accept4(listener, nullptr, nullptr, SOCK_CLOEXEC);
      if (accepted >= 0) sys_close(accepted);
    }
  }
  if (listener >= 0) sys_close(listener);
  return fd;
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
  std::vector<int> parked;  // connections waiting at relays for a dialer (-1: gone)
  uint64_t scope = 0;  // the Admission that made it (Scope::id)
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
  bool take(int fd, int backlog, const AdmissionKey& key, uint64_t scope) {
    auto listener = std::make_shared<Listener>();
    listener->gloo_fd = fd;
    listener->key = key;
    listener->scope = scope;
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
    if (listener->address.ss_family == AF_INET) {
      {  // published where the door is reached, if there is one
        std::lock_guard<std::mutex> lock(mutex_);
        if (door_) {
          listener->address = advertised_;
          listener->address_length = sizeof(sockaddr_in);
        }
      }
      ListenerId id;
      randombytes_buf(id.data(), id.size());
      std::memcpy(reinterpret_cast<sockaddr_in*>(&listener->address)->sin_zero, id.data(), id.size());
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      ::dup2(signal, fd);
      sys_close(signal);
      listeners_[fd] = listener;
      count_.fetch_add(1, std::memory_order_release);
      start_locked();
      wake();
    }
    park(listener);
    return true;
  }

  // The door (see the header): `fd` listens, non-blocking.
  void open_door(int fd, const sockaddr_storage& advertised) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (door_) sys_close(door_->tcp_fd);
    door_ = std::make_shared<Listener>();
    door_->tcp_fd = fd;
    advertised_ = advertised;
    start_locked();
    wake();
  }

  uint64_t door_admitted() {
    std::lock_guard<std::mutex> lock(mutex_);
    return door_admitted_;
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
    // Gloo takes the connection's own address as its side of the pair and,
    // when its thread gets to the pair, compares it with the peer's to decide
    // who dials. A relayed connection's own address is its outbound port to
    // the relay: with both ends on one host address (two homes on 10.0.0.2)
    // the comparison could flip, and both ends dialed. It keeps the listener's.
    if (admitted_names_.emplace(*result, Named{l.address, l.address_length}).second)
      count_.fetch_add(1, std::memory_order_release);
    return true;
  }

  bool sockname(int fd, sockaddr* address, socklen_t* length, int* result) {
    std::lock_guard<std::mutex> lock(mutex_);
    const sockaddr_storage* name = nullptr;
    socklen_t name_length = 0;
    if (auto it = listeners_.find(fd); it != listeners_.end()) {
      name = &it->second->address;
      name_length = it->second->address_length;
    } else if (auto named = admitted_names_.find(fd); named != admitted_names_.end()) {
      name = &named->second.address;
      name_length = named->second.length;
    } else {
      return false;
    }
    std::memcpy(address, name, std::min(*length, name_length));
    *length = name_length;
    *result = 0;
    return true;
  }

  void release(uint64_t scope) {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto& [fd, l] : listeners_) {
      if (l->scope != scope || l->closed || l->tcp_fd < 0 || l->admitted >= 0) continue;
      l->admitted = closed_connection();
      drop(*l);
      (void)!::eventfd_write(l->gloo_fd, 1);
    }
  }

  // A pair connection of `scope` (dialed or admitted): through a relay, or direct.
  void note_route(uint64_t scope, int fd, const ListenerId& listener) {
    std::lock_guard<std::mutex> lock(mutex_);
    note_route_locked(scope, fd, listener);
  }

  PairRoutes routes(uint64_t scope) {
    std::lock_guard<std::mutex> lock(mutex_);
    const auto it = routes_.find(scope);
    return it == routes_.end() ? PairRoutes{} : it->second;
  }

  void open_routes(uint64_t scope) {
    std::lock_guard<std::mutex> lock(mutex_);
    routes_.emplace(scope, PairRoutes{});
  }

  void forget_routes(uint64_t scope) {
    std::lock_guard<std::mutex> lock(mutex_);
    routes_.erase(scope);
  }

  // Gloo closes a listener: the side thread closes what is behind it.
  void forget(int fd) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (admitted_names_.erase(fd) > 0) count_.fetch_sub(1, std::memory_order_release);
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

  // The listeners the side thread serves: Gloo's, and the door (under -1) if there is one.
  std::map<int, std::shared_ptr<Listener>> with_door_locked() const {
    auto all = listeners_;
    if (door_) all.emplace(-1, door_);
    return all;
  }

  void note_route_locked(uint64_t scope, int fd, const ListenerId& listener) {
    const auto through = relays();
    const auto it = routes_.find(scope);
    if (!through || it == routes_.end()) return;  // a connection after its scope ended counts for nothing
    auto& r = it->second;
    ++r.connections;
    auto relay = relay_of(fd, *through);
    r.pairs.emplace_back(listener, relay.has_value());
    if (relay) {
      ++r.relayed;
      r.relay = std::move(*relay);
    }
  }

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
    for (int fd : l.parked)
      if (fd >= 0) sys_close(fd);
    l.parked.clear();
  }

  // With relays, the listener also waits at each of them for a dialer that
  // cannot reach it directly; set up off Gloo's thread, as it may take a while.
  void park(const std::shared_ptr<Listener>& listener) {
    const auto configured = relays();
    if (!configured || listener->address.ss_family != AF_INET) return;
    const auto id = listener_id(reinterpret_cast<const sockaddr*>(&listener->address));
    std::weak_ptr<Listener> weak = listener;
    for (const auto& relay : configured->at)
      std::thread([this, weak, relay, configured, id] {
        const int fd = relay_request(relay, configured->key, relay_wire::kPark, id, Clock::now() + kParkSetUp);
        if (fd < 0) return;
        std::lock_guard<std::mutex> lock(mutex_);
        const auto l = weak.lock();
        if (!l || l->closed || l->tcp_fd < 0) {
          sys_close(fd);
          return;
        }
        l->parked.push_back(fd);
        wake();
      }).detach();
  }

  // A parked connection spoke: joined to a dialer, it is proved like an accepted one.
  void read_parked(Listener& l, size_t index) {
    int& fd = l.parked[index];
    uint8_t joined = 0;
    const auto n = ::recv(fd, &joined, 1, MSG_DONTWAIT);
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return;
    if (n == 1 && joined == relay_wire::kJoined) {
      challenge(l, fd);
    } else {
      sys_close(fd);
    }
    fd = -1;
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
        for (auto& [fd, l] : with_door_locked()) {
          if (l->tcp_fd < 0) continue;
          polled.push_back({l->tcp_fd, POLLIN, 0});
          owners.emplace_back(l, -1);
          for (size_t i = 0; i < l->pending.size(); ++i) {
            polled.push_back({l->pending[i].fd, POLLIN, 0});
            owners.emplace_back(l, int(i));
            next = std::min(next, l->pending[i].until);
          }
          for (size_t i = 0; i < l->parked.size(); ++i) {
            polled.push_back({l->parked[i], POLLIN, 0});
            owners.emplace_back(l, -2 - int(i));
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
        if (index != -1 || l->closed || l->tcp_fd < 0 || !polled[k].revents) continue;
        accept_all(*l);
      }
      for (size_t k = 1; k < polled.size(); ++k) {
        auto& [l, index] = owners[k];
        if (index > -2 || l->closed || l->tcp_fd < 0 || !polled[k].revents) continue;
        read_parked(*l, size_t(-2 - index));
      }
      const auto now = Clock::now();
      for (auto& [fd, l] : with_door_locked()) {
        auto& p = l->pending;
        for (auto& c : p)
          if (c.until <= now || c.fd < 0) {
            if (c.fd >= 0) sys_close(c.fd);
            c.fd = -1;
          }
        p.erase(std::remove_if(p.begin(), p.end(), [](const Listener::Pending& c) { return c.fd < 0; }), p.end());
        l->parked.erase(std::remove(l->parked.begin(), l->parked.end(), -1), l->parked.end());
      }
    }
  }

  void accept_all(Listener& l) {
    for (;;) {
      const int fd = sys_accept4(l.tcp_fd, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0) return;
      challenge(l, fd);
    }
  }

  // A connection that must now prove the key: direct, at the door, or spliced at a relay.
  void challenge(Listener& l, int fd) {
    Listener::Pending p{fd, Clock::now() + kProofWindow, {}, {}, 0};
    randombytes_buf(p.challenge.data(), p.challenge.size());
    if (::send(fd, p.challenge.data(), p.challenge.size(), MSG_NOSIGNAL) != ssize_t(p.challenge.size())) {
      sys_close(fd);
      return;
    }
    if (l.pending.size() >= (&l == door_.get() ? kMostAtDoor : kMostPending)) {
      sys_close(l.pending.front().fd);
      l.pending.pop_front();
    }
    l.pending.push_back(p);
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
    Listener* to = addressee(l, p);
    if (!to || ::send(p.fd, &kAdmitted, 1, MSG_NOSIGNAL) != 1) {
      sys_close(p.fd);
      p.fd = -1;
      return;
    }
    // A pair takes one connection: the port closes now, as Gloo's would.
    note_route_locked(to->scope, p.fd, listener_id(reinterpret_cast<const sockaddr*>(&to->address)));
    to->admitted = p.fd;
    p.fd = -1;
    if (to != &l) ++door_admitted_;
    drop(*to);
    (void)!::eventfd_write(to->gloo_fd, 1);
  }

  // The listener a proof is for: `l` itself, or, at the door, whichever of
  // this process's waiting listeners it names (a handful at a time).
  Listener* addressee(Listener& l, const Listener::Pending& p) {
    const auto proves = [&](const Listener& to) {
      return sodium_memcmp(proof(to.key, reinterpret_cast<const sockaddr*>(&to.address), p.challenge.data()).data(),
                           p.answer.data(), kProofBytes) == 0;
    };
    if (&l != door_.get()) return proves(l) ? &l : nullptr;
    for (auto& [fd, waiting] : listeners_)
      if (!waiting->closed && waiting->tcp_fd >= 0 && waiting->admitted < 0 && proves(*waiting)) return waiting.get();
    return nullptr;
  }

  std::mutex mutex_;
  std::atomic<int> count_{0};
  std::map<int, std::shared_ptr<Listener>> listeners_;  // by Gloo's descriptor
  struct Named {
    sockaddr_storage address;
    socklen_t length;
  };
  std::map<int, Named> admitted_names_;  // connections Gloo accepted: their listener's address
  std::map<uint64_t, PairRoutes> routes_;  // by scope (Scope::id), while it lives
  std::vector<std::shared_ptr<Listener>> closed_;
  std::shared_ptr<Listener> door_;  // its tcp_fd alone: it admits for the others
  sockaddr_storage advertised_{};   // what listeners publish while there is a door
  uint64_t door_admitted_ = 0;
  int wake_fd_ = -1;
};

// The member's half, on a connecting socket (blocking or not): waits for the
// connection and the challenge, sends the proof, waits to be admitted. 0, or
// -1 with errno set; `reached` says whether a listener of ours answered.
int prove(int fd, const sockaddr* to, const AdmissionKey& key, Clock::time_point deadline, bool* reached = nullptr) {
  if (reached) *reached = false;
  if (!wait_connected(fd, deadline)) return -1;
  std::array<uint8_t, kChallengeBytes> challenge{};
  if (!read_exactly(fd, challenge.data(), challenge.size(), deadline)) return -1;
  if (reached) *reached = true;
  const auto mac = proof(key, to, challenge.data());
  if (::send(fd, mac.data(), mac.size(), MSG_NOSIGNAL | MSG_DONTWAIT) != ssize_t(mac.size())) return -1;
  uint8_t admitted = 0;
  if (!read_exactly(fd, &admitted, 1, deadline)) return -1;
  if (admitted != kAdmitted) {
    errno = ECONNREFUSED;
    return -1;
  }
  return 0;
}

// The relay watch's parks: a relay host that vanishes sends no reset, and
// idle probes find it gone within about 5 s.
void probe_when_idle(int fd) {
  const int on = 1, idle_s = 2, interval_s = 1, probes = 3;
  ::setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &on, sizeof(on));
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle_s, sizeof(idle_s));
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &interval_s, sizeof(interval_s));
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &probes, sizeof(probes));
}

std::atomic<uint64_t> relays_lost_count{0};

// Holds an idle park at each relay in use (an id nobody dials) and counts the
// ones that end: a relay says nothing to a park until it is spliced.
void watch_relays() {
  static std::once_flag started;
  std::call_once(started, [] {
    std::thread([] {
      std::map<size_t, int> parked;  // index in `watched` -> our park there
      std::map<size_t, Clock::time_point> retry_at;
      std::shared_ptr<const Relays> watched;
      for (;;) {
        const auto configured = relays();
        if (configured != watched) {  // another list (or none): its parks start afresh
          for (const auto& [i, fd] : parked) sys_close(fd);
          parked.clear();
          retry_at.clear();
          watched = configured;
        }
        if (!configured) {
          std::this_thread::sleep_for(std::chrono::milliseconds(200));
          continue;
        }
        for (size_t i = 0; i < configured->at.size(); ++i) {
          if (parked.count(i) || Clock::now() < retry_at[i]) continue;
          ListenerId id;
          randombytes_buf(id.data(), id.size());
          const int fd = relay_request(configured->at[i], configured->key, relay_wire::kPark, id,
                                       Clock::now() + std::chrono::seconds(2));
          if (fd >= 0) {
            probe_when_idle(fd);
            parked[i] = fd;
          } else {
            retry_at[i] = Clock::now() + std::chrono::seconds(2);
          }
        }
        std::vector<pollfd> polled;
        std::vector<size_t> index;
        for (const auto& [i, fd] : parked) {
          polled.push_back({fd, POLLIN | POLLRDHUP, 0});
          index.push_back(i);
        }
        if (polled.empty()) {
          std::this_thread::sleep_for(std::chrono::milliseconds(500));
          continue;
        }
        if (::poll(polled.data(), polled.size(), 500) <= 0 || relays() != watched) continue;
        for (size_t k = 0; k < polled.size(); ++k) {
          if (!polled[k].revents) continue;
          sys_close(polled[k].fd);
          parked.erase(index[k]);
          retry_at[index[k]] = Clock::now() + std::chrono::seconds(2);
          ++relays_lost_count;
          spdlog::warn("relay {} is gone: groups formed through relays are formed anew",
                       address_text(reinterpret_cast<const sockaddr*>(&configured->at[index[k]])));
        }
      }
    }).detach();
  });
}

// Through the relays, in turn: a connection spliced to the listener `to`
// names and admitted by it, or -1.
int dial_relayed(const sockaddr* to, const AdmissionKey& key, Clock::time_point deadline, const Relays& relays) {
  const auto id = listener_id(to);
  for (const auto& relay : relays.at) {
    const int fd = relay_request(relay, relays.key, relay_wire::kDial, id,
                                 std::min(deadline, Clock::now() + kParkSetUp));
    if (fd < 0) continue;
    uint8_t joined = 0;
    const auto until = std::min(deadline, Clock::now() + RelayServer::kParkWait + std::chrono::seconds(1));
    if (read_exactly(fd, &joined, 1, until) && joined == relay_wire::kJoined && prove(fd, to, key, deadline) == 0)
      return fd;
    sys_close(fd);
  }
  errno = EHOSTUNREACH;
  return -1;
}

// A connection to the listener at `to`, proved and admitted: direct where it
// answers, else (with relays) through one. Our own socket, or -1 with errno set.
int dial(const sockaddr* to, socklen_t length, const AdmissionKey& key, Clock::time_point deadline) {
  const auto through = relays();
  if (!through || to->sa_family != AF_INET || !unreachable.now(to)) {
    const int fd = ::socket(to->sa_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) return -1;
    bool reached = false;
    const auto direct_until = through ? std::min(deadline, Clock::now() + kDirectWait) : deadline;
    if ((sys_connect(fd, to, length) == 0 || errno == EINPROGRESS) && prove(fd, to, key, direct_until, &reached) == 0)
      return fd;
    const int why = errno;
    sys_close(fd);
    if (!through || to->sa_family != AF_INET) {
      errno = why;
      return -1;
    }
    // Refused at once: nobody listens there (another home's address); not worth remembering.
    if (!reached && why != ECONNREFUSED) unreachable.mark(to);
  }
  return dial_relayed(to, key, deadline, *through);
}

// Puts the connection `connected` where Gloo's socket `fd` is, with its flags.
int adopt(int fd, int connected) {
  const int status = ::fcntl(fd, F_GETFL), descriptor = ::fcntl(fd, F_GETFD);
  const int mine = ::fcntl(connected, F_GETFL);
  const int one = 1;
  ::setsockopt(connected, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  if (status < 0 || descriptor < 0 || mine < 0 ||
      ::fcntl(connected, F_SETFL, (mine & ~O_NONBLOCK) | (status & O_NONBLOCK)) != 0 ||
      ::dup3(connected, fd, (descriptor & FD_CLOEXEC) ? O_CLOEXEC : 0) < 0) {
    const int why = errno;
    sys_close(connected);
    errno = why;
    return -1;
  }
  sys_close(connected);
  return 0;
}

}  // namespace

Admission::Admission(const AdmissionKey& key, Clock::time_point deadline)
    : outer_(scope), mine_(new Scope{key, deadline, ++scopes_made}) {
  scope = static_cast<const Scope*>(mine_);
  Gatekeeper::get().open_routes(scope->id);
}

void Admission::release() { Gatekeeper::get().release(static_cast<const Scope*>(mine_)->id); }
PairRoutes Admission::routes() const { return Gatekeeper::get().routes(static_cast<const Scope*>(mine_)->id); }
Admission::~Admission() {
  Gatekeeper::get().forget_routes(static_cast<const Scope*>(mine_)->id);
  delete static_cast<const Scope*>(mine_);
  scope = static_cast<const Scope*>(outer_);
}

ListenerId listener_id(const sockaddr* address) {
  ListenerId id{};
  if (address->sa_family == AF_INET)
    std::memcpy(id.data(), reinterpret_cast<const sockaddr_in*>(address)->sin_zero, id.size());
  return id;
}

void use_relays(std::vector<sockaddr_storage> at, const RelayKey& key) {
  {
    std::lock_guard<std::mutex> lock(relays_mutex);
    configured_relays = at.empty() ? nullptr : std::make_shared<const Relays>(Relays{std::move(at), key});
  }
  if (relays()) watch_relays();
}

sockaddr_storage listen_at_door(const sockaddr_storage& door, sockaddr_storage advertised) {
  const auto text = address_text(reinterpret_cast<const sockaddr*>(&door));
  if (door.ss_family != AF_INET || advertised.ss_family != AF_INET)
    throw std::runtime_error("the door for Gloo's pairs takes IPv4 addresses only, not " + text);
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  const int on = 1;
  sockaddr_storage bound = door;
  socklen_t length = sizeof(sockaddr_in);
  if (fd < 0 || ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &on, sizeof(on)) != 0 ||
      ::bind(fd, reinterpret_cast<const sockaddr*>(&door), sizeof(sockaddr_in)) != 0 || sys_listen(fd, 512) != 0 ||
      sys_getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &length) != 0) {
    const int why = errno;
    if (fd >= 0) sys_close(fd);
    throw std::runtime_error(fmt::format("cannot listen at {} for Gloo's pairs: {}", text, std::strerror(why)));
  }
  auto& published = reinterpret_cast<sockaddr_in&>(advertised);
  if (published.sin_port == 0) published.sin_port = reinterpret_cast<const sockaddr_in&>(bound).sin_port;
  Gatekeeper::get().open_door(fd, advertised);
  return bound;
}

uint64_t door_admitted() { return Gatekeeper::get().door_admitted(); }

uint64_t relays_lost() { return relays_lost_count.load(); }

bool relays_in_use() { return relays() != nullptr; }

void knock(const sockaddr_storage& address, const AdmissionKey* key) {
  const socklen_t length = address.ss_family == AF_INET    ? sizeof(sockaddr_in)
                           : address.ss_family == AF_INET6 ? sizeof(sockaddr_in6)
                                                           : 0;
  if (length == 0) return;
  const auto* to = reinterpret_cast<const sockaddr*>(&address);
  const auto deadline = Clock::now() + std::chrono::seconds(1);
  if (key) {
    const int fd = dial(to, length, *key, deadline);
    if (fd >= 0) sys_close(fd);
    return;
  }
  const int fd = ::socket(address.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) return;
  if (sys_connect(fd, to, length) == 0 || errno == EINPROGRESS) (void)wait_for(fd, POLLOUT, deadline);
  sys_close(fd);
}

namespace {

// The calls admission stands in for, given the address they were called
// from (only libgloo.so's listen and connect are taken over). Each does
// exactly what the kernel does unless admission applies.
int listen_from(const void* caller, int fd, int backlog) {
  if (scope && called_from_gloo(caller) && Gatekeeper::get().take(fd, backlog, scope->key, scope->id)) return 0;
  return sys_listen(fd, backlog);
}

int accept_any(int fd, sockaddr* address, socklen_t* length) {
  int result;
  if (Gatekeeper::get().any() && Gatekeeper::get().accept(fd, address, length, &result)) return result;
  return sys_accept4(fd, address, length, 0);
}

int getsockname_any(int fd, sockaddr* address, socklen_t* length) {
  int result;
  if (Gatekeeper::get().any() && Gatekeeper::get().sockname(fd, address, length, &result)) return result;
  return sys_getsockname(fd, address, length);
}

int connect_from(const void* caller, int fd, const sockaddr* address, socklen_t length) {
  if (!scope || !called_from_gloo(caller) || (address->sa_family != AF_INET && address->sa_family != AF_INET6))
    return sys_connect(fd, address, length);
  int connected = dial(address, length, scope->key, scope->deadline);
  if (connected < 0) {
    const int why = errno;
    if (relays())
      spdlog::warn("no connection to a Gloo pair's listener ({}), direct or through a relay: {}", address_text(address),
                   std::strerror(why));
    else
      spdlog::warn("no connection to a Gloo pair's listener ({}): {}; a worker behind NAT or a firewall is reached "
                   "through a relay: run `noloco serve` on a public machine and give every worker its NOLOCO_RELAY",
                   address_text(address), std::strerror(why));
    connected = closed_connection();
  } else {
    Gatekeeper::get().note_route(scope->id, connected, listener_id(address));
  }
  return connected < 0 ? -1 : adopt(fd, connected);
}

int close_any(int fd) {
  if (Gatekeeper::get().any()) Gatekeeper::get().forget(fd);
  return sys_close(fd);
}

// What libgloo.so's references are bound to where the executable does not
// export the calls (bind_gloo below): each finds its own caller.
int bound_listen(int fd, int backlog) { return listen_from(__builtin_return_address(0), fd, backlog); }
int bound_connect(int fd, const sockaddr* address, socklen_t length) {
  return connect_from(__builtin_return_address(0), fd, address, length);
}

// In a process whose executable does not export the calls (Python, whose
// module's own definitions libgloo.so never sees), libgloo.so's references
// to them are bound to admission's here: their global offset table entries
// are written over, as the dynamic linker writes them when it resolves a
// name. True when every one was found.
bool bind_gloo() {
#if defined(__x86_64__)
  constexpr uint32_t kJumpSlot = R_X86_64_JUMP_SLOT, kGlobalData = R_X86_64_GLOB_DAT;
#elif defined(__aarch64__)
  constexpr uint32_t kJumpSlot = R_AARCH64_JUMP_SLOT, kGlobalData = R_AARCH64_GLOB_DAT;
#else
  return false;
#endif
  struct Binding {
    const char* name;
    void* to;
    bool bound;
  };
  std::array<Binding, 5> bindings{{{"listen", reinterpret_cast<void*>(&bound_listen), false},
                                   {"accept", reinterpret_cast<void*>(&accept_any), false},
                                   {"getsockname", reinterpret_cast<void*>(&getsockname_any), false},
                                   {"connect", reinterpret_cast<void*>(&bound_connect), false},
                                   {"close", reinterpret_cast<void*>(&close_any), false}}};
  ::dl_iterate_phdr(
      [](dl_phdr_info* info, size_t, void* data) {
        if (!is_gloo(info->dlpi_name)) return 0;
        auto& wanted = *static_cast<std::array<Binding, 5>*>(data);
        const ElfW(Dyn)* dynamic = nullptr;
        uintptr_t relro_from = 0, relro_to = 0;
        for (int i = 0; i < info->dlpi_phnum; ++i) {
          const auto& h = info->dlpi_phdr[i];
          if (h.p_type == PT_DYNAMIC) dynamic = reinterpret_cast<const ElfW(Dyn)*>(info->dlpi_addr + h.p_vaddr);
          if (h.p_type == PT_GNU_RELRO) {
            relro_from = info->dlpi_addr + h.p_vaddr;
            relro_to = relro_from + h.p_memsz;
          }
        }
        if (!dynamic) return 1;
        // glibc relocates these entries in place; a loader that does not leaves them as offsets.
        const auto at = [&](ElfW(Addr) a) { return a < info->dlpi_addr ? a + info->dlpi_addr : a; };
        const char* strings = nullptr;
        const ElfW(Sym)* symbols = nullptr;
        const ElfW(Rela)*tables[2] = {nullptr, nullptr};
        size_t sizes[2] = {0, 0};
        for (const auto* d = dynamic; d->d_tag != DT_NULL; ++d) {
          if (d->d_tag == DT_STRTAB) strings = reinterpret_cast<const char*>(at(d->d_un.d_ptr));
          if (d->d_tag == DT_SYMTAB) symbols = reinterpret_cast<const ElfW(Sym)*>(at(d->d_un.d_ptr));
          if (d->d_tag == DT_JMPREL) tables[0] = reinterpret_cast<const ElfW(Rela)*>(at(d->d_un.d_ptr));
          if (d->d_tag == DT_PLTRELSZ) sizes[0] = d->d_un.d_val;
          if (d->d_tag == DT_RELA) tables[1] = reinterpret_cast<const ElfW(Rela)*>(at(d->d_un.d_ptr));
          if (d->d_tag == DT_RELASZ) sizes[1] = d->d_un.d_val;
        }
        if (!strings || !symbols) return 1;
        const auto page = uintptr_t(::sysconf(_SC_PAGESIZE));
        for (int t = 0; t < 2; ++t)
          for (size_t k = 0; tables[t] && k < sizes[t] / sizeof(ElfW(Rela)); ++k) {
            const auto& r = tables[t][k];
            const auto type = ELF64_R_TYPE(r.r_info);
            if (type != kJumpSlot && type != kGlobalData) continue;
            const char* name = strings + symbols[ELF64_R_SYM(r.r_info)].st_name;
            for (auto& b : wanted) {
              if (std::strcmp(name, b.name) != 0) continue;
              const auto slot = info->dlpi_addr + r.r_offset;
              const bool read_only = slot >= relro_from && slot < relro_to;
              void* first = reinterpret_cast<void*>(slot & ~(page - 1));
              if (read_only && ::mprotect(first, page, PROT_READ | PROT_WRITE) != 0) continue;
              *reinterpret_cast<void**>(slot) = b.to;
              if (read_only) ::mprotect(first, page, PROT_READ);
              b.bound = true;
            }
          }
        return 1;
      },
      &bindings);
  return std::all_of(bindings.begin(), bindings.end(), [](const Binding& b) { return b.bound; });
}

bool gloo_loaded() {
  return ::dl_iterate_phdr(
             [](dl_phdr_info* info, size_t, void*) {
               return int(is_gloo(info->dlpi_name));
             },
             nullptr) != 0;
}

}  // namespace

bool admission_available() {
  if (!gloo_loaded()) return false;
  // Where the process's listen() is ours, an executable exports it (the
  // dynamic list); in a module loaded into Python, libgloo's references are
  // bound to admission's instead, once.
  Dl_info resolved{}, ours{};
  void* listen_symbol = ::dlsym(RTLD_DEFAULT, "listen");
  if (listen_symbol && ::dladdr(listen_symbol, &resolved) != 0 &&
      ::dladdr(reinterpret_cast<void*>(&admission_available), &ours) != 0 && resolved.dli_fbase == ours.dli_fbase)
    return true;
  static const bool bound = bind_gloo();
  return bound;
}

}  // namespace noloco

// The interposed names (see the header), for an executable that exports them.
extern "C" {

int listen(int fd, int backlog) { return noloco::listen_from(__builtin_return_address(0), fd, backlog); }
int accept(int fd, sockaddr* address, socklen_t* length) { return noloco::accept_any(fd, address, length); }
int getsockname(int fd, sockaddr* address, socklen_t* length) { return noloco::getsockname_any(fd, address, length); }
int connect(int fd, const sockaddr* address, socklen_t length) {
  return noloco::connect_from(__builtin_return_address(0), fd, address, length);
}
int close(int fd) { return noloco::close_any(fd); }

}  // extern "C"
