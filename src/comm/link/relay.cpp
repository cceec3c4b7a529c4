#include "comm/link/relay.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sodium.h>
#include <sys/eventfd.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <set>
#include <stdexcept>

#include <fmt/format.h>

#include "comm/link/socket_io.h"
#include "util/parse_number.h"

namespace noloco {

using Clock = std::chrono::steady_clock;

namespace relay_wire {

std::array<uint8_t, kProofBytes> request_proof(const RelayKey& key, uint8_t op, const ListenerId& id,
                                               const uint8_t* challenge) {
  std::vector<uint8_t> message{'n', 'o', 'l', 'o', 'c', 'o', ' ', 'r', 'e', 'l', 'a', 'y', op};
  message.insert(message.end(), id.begin(), id.end());
  message.insert(message.end(), challenge, challenge + kChallengeBytes);
  std::array<uint8_t, kProofBytes> mac{};
  crypto_generichash(mac.data(), mac.size(), message.data(), message.size(), key.data(), key.size());
  return mac;
}

std::array<uint8_t, kProofBytes> reflection_proof(const RelayKey& key, const uint8_t* address,
                                                  const uint8_t* challenge) {
  constexpr uint8_t kAnswer = 'A';  // not a request's op: a client's proof is never an answer's
  static_assert(kAddressBytes <= sizeof(ListenerId));
  ListenerId padded{};
  std::copy(address, address + kAddressBytes, padded.begin());
  return request_proof(key, kAnswer, padded, challenge);
}

}  // namespace relay_wire

namespace {

void set_blocking(int fd, bool blocking) {
  const int flags = ::fcntl(fd, F_GETFL);
  ::fcntl(fd, F_SETFL, blocking ? flags & ~O_NONBLOCK : flags | O_NONBLOCK);
}

bool send_all(int fd, const uint8_t* data, size_t n) {
  while (n > 0) {
    const auto w = ::send(fd, data, n, MSG_NOSIGNAL);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return false;
    data += w;
    n -= size_t(w);
  }
  return true;
}

}  // namespace

std::vector<sockaddr_storage> resolve_relays(const std::string& list) {
  std::vector<sockaddr_storage> relays;
  for (const auto& entry : comma_separated(list)) {
    const auto relay = parse_host_port("NOLOCO_RELAY entry", entry);
    if (!relay.port) throw std::invalid_argument(fmt::format("NOLOCO_RELAY entry '{}' is not host:port", entry));
    relays.push_back(resolve_ipv4(relay.host, *relay.port, fmt::format("NOLOCO_RELAY entry '{}'", entry)));
  }
  if (relays.empty()) throw std::invalid_argument("NOLOCO_RELAY is set but names no relay (host:port,...)");
  return relays;
}

int relay_request(const sockaddr_storage& relay, const RelayKey& key, uint8_t op, const ListenerId& id,
                  Clock::time_point deadline) {
  const int fd = tcp_socket();
  if (fd < 0) return -1;
  const auto fail = [fd] {
    const int saved = errno;
    ::close(fd);
    errno = saved;
    return -1;
  };
  if (::connect(fd, reinterpret_cast<const sockaddr*>(&relay), sizeof(sockaddr_in)) != 0 && errno != EINPROGRESS)
    return fail();
  if (!wait_connected(fd, deadline)) return fail();
  std::array<uint8_t, relay_wire::kChallengeBytes> challenge{};
  if (!read_exactly(fd, challenge.data(), challenge.size(), deadline)) return fail();
  std::array<uint8_t, relay_wire::kRequestBytes> request{};
  request[0] = op;
  std::copy(id.begin(), id.end(), request.begin() + 1);
  const auto mac = relay_wire::request_proof(key, op, id, challenge.data());
  std::copy(mac.begin(), mac.end(), request.begin() + 1 + id.size());
  if (::send(fd, request.data(), request.size(), MSG_NOSIGNAL | MSG_DONTWAIT) != ssize_t(request.size()))
    return fail();
  set_nodelay(fd);
  return fd;
}

// What the splices carry, shared with their threads: the server may go
// while they finish.
struct RelayServer::Carried {
  std::atomic<int64_t> bytes{0}, live{0};
  std::mutex mutex;
  std::set<int> fds;  // open spliced connections, shut down when the server stops
};

struct RelayServer::Connection {
  enum class State { proving, parked, dialing } state = State::proving;
  int fd = -1;
  Clock::time_point until;
  std::array<uint8_t, relay_wire::kChallengeBytes> challenge{};
  std::array<uint8_t, relay_wire::kRequestBytes> request{};
  size_t received = 0;
  ListenerId id{};
};

RelayServer::RelayServer(const std::string& bind, int port, const RelayKey& key)
    : key_(key), carried_(std::make_shared<Carried>()) {
  if (sodium_init() < 0) throw std::runtime_error("relay: libsodium did not initialise");
  listen_fd_ = listen_socket(bind, port, 1024, "relay");
  port_ = local_port(listen_fd_);
  if (rlimit files{}; ::getrlimit(RLIMIT_NOFILE, &files) == 0 && files.rlim_cur != RLIM_INFINITY)
    most_strangers_ = std::min(kMostStrangers, std::max<size_t>(16, size_t(files.rlim_cur) / 2));
  wake_fd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  thread_ = std::thread([this] { serve(); });
}

RelayServer::~RelayServer() {
  stopping_ = true;
  (void)!::eventfd_write(wake_fd_, 1);
  thread_.join();
  {
    std::lock_guard<std::mutex> lock(carried_->mutex);
    for (int fd : carried_->fds) ::shutdown(fd, SHUT_RDWR);
  }
  // The splices' threads hold only what they share with the server's stats; they end once their ends are shut.
  for (int i = 0; i < 500 && carried_->live.load() > 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  for (auto& c : connections_) ::close(c->fd);
  ::close(listen_fd_);
  ::close(wake_fd_);
}

RelayStats RelayServer::stats() const {
  return {spliced_.load(),        refused_.load(),    carried_->bytes.load(), carried_->live.load(),
          parked_now_.load(), reflected_.load()};
}

void RelayServer::serve() {
  while (!stopping_) {
    const bool accepting = Clock::now() >= accept_paused_until_;
    // poll() skips a negative descriptor: a resting listener does not wake it.
    std::vector<pollfd> polled{{wake_fd_, POLLIN, 0}, {accepting ? listen_fd_ : -1, POLLIN, 0}};
    auto next = accepting ? Clock::now() + std::chrono::seconds(1) : accept_paused_until_;
    for (auto& c : connections_) {
      polled.push_back({c->fd, POLLIN, 0});
      if (c->state != Connection::State::parked) next = std::min(next, c->until);
    }
    const auto wait = std::chrono::duration_cast<std::chrono::milliseconds>(next - Clock::now()).count();
    ::poll(polled.data(), polled.size(), int(std::max<int64_t>(0, wait) + 1));
    if (stopping_) return;
    eventfd_t ignored;
    (void)::eventfd_read(wake_fd_, &ignored);
    // Connections polled are connections_[0, polled.size() - 2): accepting appends.
    const size_t polled_connections = polled.size() - 2;
    for (size_t k = 0; k < polled_connections; ++k)
      if (polled[k + 2].revents && connections_[k]->fd >= 0) read_request(*connections_[k]);
    if (polled[1].revents) accept_all();
    const auto now = Clock::now();
    for (auto& c : connections_)
      if (c->fd >= 0 && c->state != Connection::State::parked && c->until <= now) {
        if (c->state == Connection::State::proving) ++refused_;
        close_connection(*c);
      }
    connections_.erase(std::remove_if(connections_.begin(), connections_.end(),
                                      [](const std::unique_ptr<Connection>& c) { return c->fd < 0; }),
                       connections_.end());
  }
}

void RelayServer::accept_all() {
  for (;;) {
    const int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      // Out of descriptors, the connection stays queued and the listener
      // readable: a stranger makes room, or the listener rests a moment
      // (before, poll() woke at once again, for ever: 14 s of CPU in 20).
      const bool out_of_descriptors = errno == EMFILE || errno == ENFILE;
      if (out_of_descriptors && drop_oldest_stranger()) continue;
      if (out_of_descriptors) accept_paused_until_ = Clock::now() + std::chrono::milliseconds(100);
      return;
    }
    auto c = std::make_unique<Connection>();
    c->fd = fd;
    c->until = Clock::now() + kProofWindow;
    randombytes_buf(c->challenge.data(), c->challenge.size());
    if (::send(fd, c->challenge.data(), c->challenge.size(), MSG_NOSIGNAL) != ssize_t(c->challenge.size())) {
      ::close(fd);
      continue;
    }
    const auto strangers = size_t(std::count_if(connections_.begin(), connections_.end(), [](const auto& held) {
      return held->fd >= 0 && held->state == Connection::State::proving;
    }));
    if (strangers >= most_strangers_) drop_oldest_stranger();
    connections_.push_back(std::move(c));
  }
}

bool RelayServer::drop_oldest_stranger() {
  for (auto& held : connections_)
    if (held->fd >= 0 && held->state == Connection::State::proving) {
      ++refused_;
      close_connection(*held);
      return true;
    }
  return false;
}

void RelayServer::read_request(Connection& c) {
  if (c.state != Connection::State::proving) {
    // A parked or waiting connection says nothing until it is spliced: data or EOF ends it.
    close_connection(c);
    return;
  }
  const auto n = ::recv(c.fd, c.request.data() + c.received, c.request.size() - c.received, 0);
  if (n <= 0) {
    if (n == 0 || (errno != EAGAIN && errno != EWOULDBLOCK)) {
      ++refused_;
      close_connection(c);
    }
    return;
  }
  c.received += size_t(n);
  if (c.received < c.request.size()) return;
  const uint8_t op = c.request[0];
  std::copy(c.request.begin() + 1, c.request.begin() + 1 + long(c.id.size()), c.id.begin());
  const auto expected = relay_wire::request_proof(key_, op, c.id, c.challenge.data());
  if ((op != relay_wire::kPark && op != relay_wire::kDial && op != relay_wire::kReflect) ||
      sodium_memcmp(expected.data(), c.request.data() + 1 + c.id.size(), expected.size()) != 0) {
    ++refused_;
    close_connection(c);
    return;
  }
  if (op == relay_wire::kReflect) {
    reflect(c);
    return;
  }
  const auto parked = parked_.find(c.id);
  if (op == relay_wire::kPark) {
    if (parked != parked_.end()) {  // one listener, one park
      close_connection(c);
      return;
    }
    c.state = Connection::State::parked;
    parked_[c.id] = &c;
    parked_now_ = int64_t(parked_.size());
    for (auto& other : connections_)
      if (other->fd >= 0 && other->state == Connection::State::dialing && other->id == c.id) {
        splice(c, *other);
        return;
      }
    return;
  }
  c.state = Connection::State::dialing;
  c.until = Clock::now() + kParkWait;
  if (parked != parked_.end()) splice(*parked->second, c);
}

void RelayServer::reflect(Connection& c) {
  sockaddr_storage seen{};
  socklen_t length = sizeof(seen);
  std::array<uint8_t, relay_wire::kReflectionBytes> answer{};
  if (::getpeername(c.fd, reinterpret_cast<sockaddr*>(&seen), &length) == 0 && seen.ss_family == AF_INET) {
    const auto& in = reinterpret_cast<const sockaddr_in&>(seen);
    std::memcpy(answer.data(), &in.sin_addr, 4);
    std::memcpy(answer.data() + 4, &in.sin_port, 2);
  }
  const auto proof = relay_wire::reflection_proof(key_, answer.data(), c.challenge.data());
  std::copy(proof.begin(), proof.end(), answer.begin() + relay_wire::kAddressBytes);
  ++reflected_;  // before the answer: a client that has it reads the count with it
  (void)!::send(c.fd, answer.data(), answer.size(), MSG_NOSIGNAL);
  close_connection(c);
}

void RelayServer::close_connection(Connection& c) {
  if (c.fd < 0) return;
  const auto parked = parked_.find(c.id);
  if (c.state == Connection::State::parked && parked != parked_.end() && parked->second == &c) parked_.erase(parked);
  parked_now_ = int64_t(parked_.size());
  ::close(c.fd);
  c.fd = -1;
}

void RelayServer::splice(Connection& listener, Connection& dialer) {
  parked_.erase(listener.id);
  parked_now_ = int64_t(parked_.size());
  const int a = listener.fd, b = dialer.fd;
  listener.fd = dialer.fd = -1;
  const uint8_t joined = relay_wire::kJoined;
  if (::send(a, &joined, 1, MSG_NOSIGNAL) != 1 || ::send(b, &joined, 1, MSG_NOSIGNAL) != 1) {
    ::close(a);
    ::close(b);
    return;
  }
  ++spliced_;
  auto carried = carried_;
  {
    std::lock_guard<std::mutex> lock(carried->mutex);
    carried->fds.insert(a);
    carried->fds.insert(b);
  }
  carried->live += 1;
  // Each direction on its own thread: a direction blocked on a slow uplink
  // never holds back the other (one thread reading both ends in turn carried
  // a pair's two directions one after the other).
  auto pump = [carried](int from, int to) {
    std::vector<uint8_t> buffer(1 << 18);
    for (;;) {
      const auto n = ::recv(from, buffer.data(), buffer.size(), 0);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) break;
      carried->bytes += n;  // before they go on: whoever has them reads the count with them
      if (!send_all(to, buffer.data(), size_t(n))) break;
    }
    // One end went: the other sees its connection close.
    ::shutdown(from, SHUT_RDWR);
    ::shutdown(to, SHUT_RDWR);
  };
  std::thread([carried, a, b, pump] {
    set_blocking(a, true);
    set_blocking(b, true);
    set_nodelay(a);
    set_nodelay(b);
    std::thread back(pump, b, a);
    pump(a, b);
    back.join();
    {
      std::lock_guard<std::mutex> lock(carried->mutex);
      carried->fds.erase(a);
      carried->fds.erase(b);
    }
    ::close(a);
    ::close(b);
    --carried->live;
  }).detach();
}

}  // namespace noloco
