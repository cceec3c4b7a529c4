#include "comm/link/link_endpoint.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "comm/link/socket_io.h"
#include "util/parse_number.h"

namespace noloco {

namespace {

std::string text_of(const sockaddr_storage& a) {
  const auto& in = reinterpret_cast<const sockaddr_in&>(a);
  char host[INET_ADDRSTRLEN] = {0};
  ::inet_ntop(AF_INET, &in.sin_addr, host, sizeof(host));
  return fmt::format("{}:{}", host, ntohs(in.sin_port));
}

// "ip:port" as an address; false if it is not one.
bool address_of(const std::string& text, sockaddr_storage* out) {
  try {
    const auto address = parse_host_port("address", text);
    if (!address.port) return false;
    *out = resolve_ipv4(address.host, *address.port, "address");
    return true;
  } catch (const std::exception&) {
    return false;
  }
}

bool on_loopback(const std::string& address) {
  sockaddr_storage a{};
  return address_of(address, &a) &&
         (ntohl(reinterpret_cast<const sockaddr_in&>(a).sin_addr.s_addr) >> 24) == 127;  // 127.0.0.0/8
}

// A socket bound to `bind`:`port` that other sockets may share (the punching port).
int shared_socket(const std::string& bind, int port) {
  const int fd = tcp_socket();
  if (fd < 0) return -1;
  const int one = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEPORT, &one, sizeof(one));
  auto at = resolve_ipv4(bind, port, "bind");
  if (::bind(fd, reinterpret_cast<const sockaddr*>(&at), sizeof(sockaddr_in)) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

// A connection begun from `fd` to `to` (non-blocking); false if it failed at once.
bool begin_connect(int fd, const sockaddr_storage& to) {
  return ::connect(fd, reinterpret_cast<const sockaddr*>(&to), sizeof(sockaddr_in)) == 0 || errno == EINPROGRESS;
}

// 0: still connecting; 1: connected; -1: failed.
int connect_state(int fd) {
  pollfd p{fd, POLLOUT, 0};
  if (::poll(&p, 1, 0) <= 0) return 0;
  int error = 0;
  socklen_t length = sizeof(error);
  ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &error, &length);
  return error == 0 ? 1 : -1;
}

// Where the relay at `relay` sees a connection from local port `port` come
// from, asked until `deadline` (a relay starting with the run may not listen
// yet); "" if it never said, or if the answer's proof is not the relay's (it
// was rewritten on the way: no punch is aimed by it).
std::string reflected(const sockaddr_storage& relay, const RelayKey& key, const std::string& bind, int port,
                      Clock::time_point deadline) {
  std::array<uint8_t, relay_wire::kReflectionBytes> answer{};
  std::array<uint8_t, relay_wire::kChallengeBytes> challenge{};
  bool ok = false;
  while (!ok && Clock::now() < deadline) {
    const int fd = shared_socket(bind, port);
    if (fd < 0) return "";
    const ListenerId none{};
    ok = begin_connect(fd, relay) && wait_connected(fd, deadline) &&
         read_exactly(fd, challenge.data(), challenge.size(), deadline);
    if (ok) {
      std::array<uint8_t, relay_wire::kRequestBytes> request{};
      request[0] = relay_wire::kReflect;
      const auto mac = relay_wire::request_proof(key, relay_wire::kReflect, none, challenge.data());
      std::copy(mac.begin(), mac.end(), request.begin() + 1 + none.size());
      ok = write_exactly(fd, request.data(), request.size(), deadline) &&
           read_exactly(fd, answer.data(), answer.size(), deadline);
    }
    ::close(fd);
    if (!ok) std::this_thread::sleep_until(std::min(deadline, Clock::now() + std::chrono::milliseconds(200)));
  }
  if (!ok) return "";
  const auto proof = relay_wire::reflection_proof(key, answer.data(), challenge.data());
  if (sodium_memcmp(proof.data(), answer.data() + relay_wire::kAddressBytes, proof.size()) != 0) {
    spdlog::warn("links: the relay at {} answered where it sees this worker with a proof that is not the relay's "
                 "(changed on the way, or not our relay): no hole is punched from its answer",
                 text_of(relay));
    return "";
  }
  if (std::all_of(answer.begin(), answer.begin() + relay_wire::kAddressBytes, [](uint8_t b) { return b == 0; }))
    return "";
  sockaddr_storage seen{};
  auto& in = reinterpret_cast<sockaddr_in&>(seen);
  in.sin_family = AF_INET;
  std::memcpy(&in.sin_addr, answer.data(), 4);
  std::memcpy(&in.sin_port, answer.data() + 4, 2);
  return text_of(seen);
}

}  // namespace

struct LinkEndpoint::Pending {
  int fd;
  Clock::time_point until;
  AcceptHandshake handshake;
};

LinkEndpoint::LinkEndpoint(const LinkEndpointOptions& options, const LinkKey& link_key, const RelayKey& relay_key)
    : options_(options),
      uplink_(options.uplink > 0 ? std::make_shared<UplinkShare>(options.uplink) : nullptr),
      key_(link_key),
      relay_key_(relay_key) {
  if (sodium_init() < 0) throw std::runtime_error("links: libsodium did not initialise");
  for (const auto& r : options.relays) {
    sockaddr_storage a{};
    if (!address_of(r, &a)) throw std::invalid_argument(fmt::format("relay '{}' is not ip:port", r));
    relays_.push_back(a);
  }
  listen_fd_ = listen_socket(options.bind, options.port, 256, "links");
  port_ = local_port(listen_fd_);
  addresses_.listen = fmt::format("{}:{}", options.bind, port_);
  if (!options.advertise.empty()) {
    addresses_.listen = parse_host_port("advertise", options.advertise).port
                            ? options.advertise
                            : fmt::format("{}:{}", options.advertise, port_);
    addresses_.reachable = true;
  }
  first_punch_ = new_punch_slot();
  addresses_.reflexive = first_punch_.reflexive;
  wake_fd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  thread_ = std::thread([this] { listen_loop(); });
}

LinkEndpoint::~LinkEndpoint() {
  stopping_ = true;
  (void)!::eventfd_write(wake_fd_, 1);
  thread_.join();
  ::close(listen_fd_);
  ::close(wake_fd_);
}

LinkEndpoint::Counts LinkEndpoint::counts() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return counts_;
}

LinkEndpoint::PunchSlot LinkEndpoint::new_punch_slot() const {
  PunchSlot slot;
  if (relays_.empty()) return slot;
  const int punch = shared_socket(options_.bind, 0);
  if (punch < 0) return slot;
  slot.port = local_port(punch);
  ::close(punch);
  for (const auto& relay : relays_)
    if (!(slot.reflexive = reflected(relay, relay_key_, options_.bind, slot.port,
                                     Clock::now() + std::chrono::milliseconds(1500)))
             .empty())
      break;
  return slot;
}

void LinkEndpoint::serve(const LinkEnd& end) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    served_.insert(end);
    if (punches_.count(end.scope)) return;
    // Without a reflexive address (no relay, or it did not answer) nothing is punched: no port to ask about.
    if (first_punch_.reflexive.empty() || punches_.empty()) {
      punches_[end.scope] = first_punch_;
      return;
    }
  }
  const auto slot = new_punch_slot();  // a relay's round trip: not under the lock
  std::lock_guard<std::mutex> lock(mutex_);
  punches_.emplace(end.scope, slot);
}

LinkEndpoint::PunchSlot LinkEndpoint::punch_slot(const std::string& scope) const {
  std::lock_guard<std::mutex> lock(mutex_);
  const auto it = punches_.find(scope);
  return it == punches_.end() ? first_punch_ : it->second;
}

LinkAddresses LinkEndpoint::addresses(const LinkEnd& self) const {
  auto a = addresses_;
  a.reflexive = punch_slot(self.scope).reflexive;
  return a;
}

void LinkEndpoint::unserve(const LinkEnd& end) {
  std::lock_guard<std::mutex> lock(mutex_);
  served_.erase(end);
  for (auto it = inbox_.begin(); it != inbox_.end();) it = it->first.first == end ? inbox_.erase(it) : std::next(it);
}

bool LinkEndpoint::wanted(const Hello& hello) const {
  std::lock_guard<std::mutex> lock(mutex_);
  if (hello.sealed != options_.sealed) return false;
  return std::any_of(served_.begin(), served_.end(), [&](const LinkEnd& e) {
    return e.rank == hello.acceptor_rank && e.incarnation == hello.acceptor_incarnation &&
           scope_hash(e.scope) == hello.scope;
  });
}

void LinkEndpoint::listen_loop() {
  std::vector<std::unique_ptr<Pending>> pending;
  auto refuse = [&](Pending& p) {
    ::close(p.fd);
    p.fd = -1;
    std::lock_guard<std::mutex> lock(mutex_);
    ++counts_.refused;
  };
  while (!stopping_) {
    std::vector<pollfd> polled{{wake_fd_, POLLIN, 0}, {listen_fd_, POLLIN, 0}};
    for (auto& p : pending) polled.push_back({p->fd, POLLIN, 0});
    ::poll(polled.data(), polled.size(), 250);
    if (stopping_) break;
    const auto now = Clock::now();
    for (size_t k = 0; k < pending.size(); ++k) {
      auto& p = *pending[k];
      if (!polled[k + 2].revents) {
        if (now > p.until) refuse(p);
        continue;
      }
      std::array<uint8_t, 128> buffer{};
      const auto n = ::recv(p.fd, buffer.data(), std::min(buffer.size(), p.handshake.wants()), MSG_DONTWAIT);
      if (n <= 0) {
        if (n == 0 || (errno != EAGAIN && errno != EINTR)) refuse(p);
        continue;
      }
      size_t used = 0;
      switch (p.handshake.feed(buffer.data(), size_t(n), &used)) {
        case AcceptHandshake::Step::more: break;
        case AcceptHandshake::Step::answer:
          if (!write_exactly(p.fd, p.handshake.answer().data(), p.handshake.answer().size(), now + std::chrono::seconds(1)))
            refuse(p);
          break;
        case AcceptHandshake::Step::done:
          deliver(p.handshake, p.fd, LinkRoute::direct, "");
          p.fd = -1;
          break;
        case AcceptHandshake::Step::refused: refuse(p);
      }
    }
    pending.erase(std::remove_if(pending.begin(), pending.end(), [](const auto& p) { return p->fd < 0; }), pending.end());
    if (polled[1].revents)
      for (int fd; (fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC)) >= 0;) {
        if (pending.size() >= kMostStrangers) {
          refuse(*pending.front());
          pending.erase(pending.begin());
        }
        pending.push_back(std::make_unique<Pending>(
            Pending{fd, Clock::now() + kProofWindow, AcceptHandshake(key_, [this](const Hello& h) { return wanted(h); })}));
      }
  }
  for (auto& p : pending) ::close(p->fd);
}

void LinkEndpoint::deliver(const AcceptHandshake& handshake, int fd, LinkRoute route, const std::string& relay) {
  const auto& h = handshake.hello();
  std::lock_guard<std::mutex> lock(mutex_);
  const auto self = std::find_if(served_.begin(), served_.end(), [&](const LinkEnd& e) {
    return e.rank == h.acceptor_rank && e.incarnation == h.acceptor_incarnation && scope_hash(e.scope) == h.scope;
  });
  if (self == served_.end()) {
    ::close(fd);
    return;
  }
  const LinkEnd dialer{self->scope, h.dialer_rank, h.dialer_incarnation};
  const auto keys = handshake.keys();
  inbox_[{*self, dialer}] = {std::make_shared<Link>(fd, route, *self, dialer, keys, h.sealed, relay), h.attempt};
  ++counts_.accepted;
  arrived_.notify_all();
}

LinkPtr LinkEndpoint::take(const LinkEnd& self, const LinkEnd& peer, const std::string& attempt) {
  const auto wanted = attempt_hash(attempt);
  std::unique_lock<std::mutex> lock(mutex_);
  const auto for_this = [&] {
    const auto it = inbox_.find({self, peer});
    return it != inbox_.end() && it->second.attempt == wanted;
  };
  // A link dialed for another attempt stays: its dialer is ahead of this
  // end (it is taken at that attempt) or behind (a newer dial replaces it).
  if (!arrived_.wait_for(lock, std::chrono::milliseconds(50), for_this)) return nullptr;
  const auto it = inbox_.find({self, peer});
  auto link = it->second.link;
  inbox_.erase(it);
  return link;
}

bool LinkEndpoint::dials(const LinkEnd& self, const LinkEnd& peer, const LinkAddresses& theirs) const {
  if (theirs.reachable != addresses_.reachable) return theirs.reachable;
  return std::make_pair(self.rank, self.incarnation) < std::make_pair(peer.rank, peer.incarnation);
}

ListenerId LinkEndpoint::pair_id(const LinkEnd& dialer, const LinkEnd& acceptor, const std::string& attempt) const {
  const auto text = fmt::format("noloco link pair {}|{}|{}", dialer.name(), acceptor.name(), attempt);
  ListenerId id{};
  crypto_generichash(id.data(), id.size(), reinterpret_cast<const uint8_t*>(text.data()), text.size(), relay_key_.data(),
                     relay_key_.size());
  return id;
}

LinkPtr LinkEndpoint::open(const LinkEnd& self, const LinkEnd& peer, const LinkAddresses& theirs,
                           const std::string& attempt, Clock::time_point deadline,
                           const std::function<bool()>& abandon, std::string* problem) {
  problem->clear();
  const bool dialer = dials(self, peer, theirs);
  auto link = dialer ? dial(self, peer, theirs, attempt, deadline, abandon, problem)
                     : await(self, peer, theirs, attempt, deadline, abandon, problem);
  if (!link) return nullptr;
  if (!(dialer ? link->await_confirmation(deadline, abandon) : link->confirm(deadline))) {
    *problem = link->problem();
    return nullptr;
  }
  // A hole or a relay is reached through this machine's router; a direct
  // link to a peer on its own network (a second machine at home) is not.
  if (uplink_ && (link->route() != LinkRoute::direct || !link->far_end_on_local_network())) link->share_uplink(uplink_);
  return link;
}

LinkPtr LinkEndpoint::dial(const LinkEnd& self, const LinkEnd& peer, const LinkAddresses& theirs,
                           const std::string& attempt, Clock::time_point deadline,
                           const std::function<bool()>& abandon, std::string* problem) {
  const auto start = Clock::now();
  const bool relayed = !relays_.empty();
  const auto say = [&](const std::string& what) { *problem += (problem->empty() ? "" : "; ") + what; };
  const auto stop = [&] { return Clock::now() >= deadline || (abandon && abandon()); };
  sockaddr_storage to{};
  if (address_of(theirs.listen, &to)) {
    const auto until = relayed ? std::min(deadline, start + kDirectWindow) : deadline;
    while (Clock::now() < until && !stop()) {
      // From its bind= address, as its peers and routers were told (a
      // loopback one reaches only loopback: elsewhere the kernel chooses).
      const bool from_bind = !on_loopback(options_.bind + ":0") || on_loopback(theirs.listen);
      const int fd = from_bind ? shared_socket(options_.bind, 0) : tcp_socket();
      if (fd < 0) {
        say(fmt::format("direct: cannot dial from {}: {}", options_.bind, std::strerror(errno)));
        break;
      }
      const auto attempt_until = std::min(until, Clock::now() + std::chrono::milliseconds(500));
      if (begin_connect(fd, to) && wait_connected(fd, attempt_until)) {
        std::string why;
        if (auto link = dial_handshake(fd, key_, options_.sealed, self, peer, attempt, LinkRoute::direct, "", until, &why)) return link;
        say(fmt::format("direct to {}: {}", theirs.listen, why));
        break;  // a listener that is not the peer's (another home on the same LAN address)
      }
      const int error = errno;
      ::close(fd);
      if (error != ECONNREFUSED && error != ETIMEDOUT && error != EINPROGRESS) {
        say(fmt::format("direct to {}: {}", theirs.listen, std::strerror(error)));
        break;
      }
      std::this_thread::sleep_until(std::min(until, Clock::now() + std::chrono::milliseconds(100)));
    }
  }
  // Then a hole and the relays, again and again until the deadline: a peer
  // that comes late (behind after a store outage) finds this end punching
  // anew, instead of a dialer that gave up after one pass.
  sockaddr_storage hole{};
  const auto mine = punch_slot(self.scope);
  const bool punching = relayed && mine.port && !mine.reflexive.empty() && address_of(theirs.reflexive, &hole);
  const auto tried_direct = *problem;
  while (relayed && !stop()) {
    *problem = tried_direct;  // what the last pass found, not every pass's
    if (punching) {
      const auto until = std::min(deadline, Clock::now() + kPunchWindow);
      while (Clock::now() < until && !stop()) {
        const int fd = shared_socket(options_.bind, mine.port);
        if (fd >= 0 && begin_connect(fd, hole)) {
          int state = 0;
          while (state == 0 && Clock::now() < until && !stop()) {
            pollfd p{fd, POLLOUT, 0};
            ::poll(&p, 1, 50);
            state = connect_state(fd);
          }
          if (state == 1) {
            // Whoever answered at the hole may not be the peer, nor say anything: the relay is still to try.
            std::string why;
            if (auto link = dial_handshake(fd, key_, options_.sealed, self, peer, attempt, LinkRoute::punched, "",
                                           std::min(deadline, Clock::now() + kPunchWindow), &why))
              return link;
            say("punched: " + why);
            break;
          }
        }
        if (fd >= 0) ::close(fd);
        std::this_thread::sleep_until(std::min(until, Clock::now() + std::chrono::milliseconds(100)));
      }
      if (problem->find("punched") == std::string::npos) say(fmt::format("no hole punched to {}", theirs.reflexive));
    }
    const auto id = pair_id(self, peer, attempt);
    for (size_t r = 0; r < relays_.size() && !stop(); ++r) {
      const int fd = relay_request(relays_[r], relay_key_, relay_wire::kDial, id, deadline);
      uint8_t joined = 0;
      if (fd >= 0 && read_exactly(fd, &joined, 1, deadline) && joined == relay_wire::kJoined) {
        std::string why;
        if (auto link = dial_handshake(fd, key_, options_.sealed, self, peer, attempt, LinkRoute::relayed,
                                       text_of(relays_[r]), deadline, &why))
          return link;
        say(fmt::format("through relay {}: {}", text_of(relays_[r]), why));
        continue;
      }
      say(fmt::format("relay {}: {}", text_of(relays_[r]), fd < 0 ? std::strerror(errno) : "the peer never parked"));
      if (fd >= 0) ::close(fd);
    }
    std::this_thread::sleep_until(std::min(deadline, Clock::now() + std::chrono::milliseconds(200)));
  }
  if (problem->empty() || relays_.empty())
    say(stop() && Clock::now() < deadline ? "given up" : fmt::format("no way to the peer ({}) in time", theirs.listen));
  // A peer at a loopback address is on this machine: no router stands between, it did not take the link.
  if (relays_.empty() && !on_loopback(theirs.listen))
    say("behind NAT or a firewall, run `noloco serve` on a public machine and give every worker its NOLOCO_RELAY");
  return nullptr;
}

LinkPtr LinkEndpoint::accept_on(int fd, const LinkEnd& self, const LinkEnd& peer, const std::string& attempt,
                                LinkRoute route, const std::string& relay, Clock::time_point deadline,
                                std::string* problem) {
  AcceptHandshake handshake(key_, [&](const Hello& h) {
    return h.sealed == options_.sealed && h.acceptor_rank == self.rank && h.acceptor_incarnation == self.incarnation &&
           h.dialer_rank == peer.rank && h.dialer_incarnation == peer.incarnation && h.scope == scope_hash(self.scope) &&
           h.attempt == attempt_hash(attempt);
  });
  for (;;) {
    std::vector<uint8_t> buffer(handshake.wants());
    if (!read_exactly(fd, buffer.data(), buffer.size(), deadline)) break;
    size_t used = 0;
    const auto step = handshake.feed(buffer.data(), buffer.size(), &used);
    if (step == AcceptHandshake::Step::refused) break;
    if (step == AcceptHandshake::Step::answer &&
        !write_exactly(fd, handshake.answer().data(), handshake.answer().size(), deadline))
      break;
    if (step == AcceptHandshake::Step::done) {
      const auto keys = handshake.keys();
      return std::make_shared<Link>(fd, route, self, peer, keys, options_.sealed, relay);
    }
  }
  *problem += fmt::format("{}{}: the handshake failed", problem->empty() ? "" : "; ", route_name(route));
  ::close(fd);
  return nullptr;
}

LinkPtr LinkEndpoint::await(const LinkEnd& self, const LinkEnd& peer, const LinkAddresses& theirs,
                            const std::string& attempt, Clock::time_point deadline,
                            const std::function<bool()>& abandon, std::string* problem) {
  const auto start = Clock::now();
  const bool relayed = !relays_.empty();
  sockaddr_storage hole{};
  const auto mine = punch_slot(self.scope);
  const bool punching = relayed && mine.port && !mine.reflexive.empty() && address_of(theirs.reflexive, &hole);
  const auto punch_until = start + kDirectWindow + kPunchWindow;
  int punch = -1;
  std::vector<std::pair<int, size_t>> parks;  // fd, relay
  bool parked = false;
  auto close_all = [&] {
    if (punch >= 0) ::close(punch);
    for (auto& [fd, r] : parks) ::close(fd);
    parks.clear();
    punch = -1;
  };
  while (Clock::now() < deadline && !(abandon && abandon())) {
    if (auto link = take(self, peer, attempt)) {
      close_all();
      return link;
    }
    const auto now = Clock::now();
    // Punching all the while: a dialer that comes late punches when it comes.
    if (punching) {
      if (punch < 0 && (punch = shared_socket(options_.bind, mine.port)) >= 0 && !begin_connect(punch, hole)) {
        ::close(punch);
        punch = -1;
      }
      const int state = punch >= 0 ? connect_state(punch) : 0;
      if (state == 1) {
        const int fd = punch;
        punch = -1;
        if (auto link = accept_on(fd, self, peer, attempt, LinkRoute::punched, "", std::min(deadline, now + std::chrono::seconds(2)),
                                  problem)) {
          close_all();
          return link;
        }
      } else if (state == -1) {
        ::close(punch);
        punch = -1;
      }
    }
    if (relayed && !parked && (!punching || now >= punch_until)) {
      parked = true;
      const auto id = pair_id(peer, self, attempt);
      for (size_t r = 0; r < relays_.size(); ++r) {
        const int fd = relay_request(relays_[r], relay_key_, relay_wire::kPark, id, std::min(deadline, now + std::chrono::seconds(2)));
        if (fd >= 0) parks.emplace_back(fd, r);
      }
    }
    for (auto it = parks.begin(); it != parks.end();) {
      pollfd p{it->first, POLLIN, 0};
      uint8_t joined = 0;
      if (::poll(&p, 1, 0) <= 0) {
        ++it;
        continue;
      }
      const int fd = it->first;
      const size_t r = it->second;
      it = parks.erase(it);
      if (::recv(fd, &joined, 1, MSG_DONTWAIT) == 1 && joined == relay_wire::kJoined) {
        if (auto link = accept_on(fd, self, peer, attempt, LinkRoute::relayed, text_of(relays_[r]), deadline, problem)) {
          close_all();
          return link;
        }
      } else {
        ::close(fd);
      }
    }
  }
  close_all();
  *problem += fmt::format("{}no link from {} in time{}", problem->empty() ? "" : "; ", peer.name(),
                          abandon && abandon() ? " (given up)" : "");
  return nullptr;
}

}  // namespace noloco
