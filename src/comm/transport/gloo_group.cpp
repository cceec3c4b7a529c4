#include "comm/transport/gloo_group.h"

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <mutex>
#include <optional>

#include <fmt/format.h>
#include <spdlog/spdlog.h>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/torch.h>

#include "comm/store/abandonable_store.h"
#include "comm/link/socket_io.h"
#include "comm/store/run_keys.h"
#include "comm/store/store.h"
#include "comm/transport/seal.h"
#include "comm/transport/ticker.h"
#include "util/error_text.h"
#include "wire/message.h"

namespace noloco {

namespace {

using Clock = std::chrono::steady_clock;

// Apart from every tag the group's collectives use.
constexpr int kGreetingTag = 1 << 30;

std::chrono::milliseconds left_until(Clock::time_point deadline) {
  return std::max(std::chrono::milliseconds(0),
                  std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()));
}

// Every member sends every other its own index, under a header naming the
// run and the try, over their pair, and checks what comes back: a pair that
// a stranger took gets nothing (or garbage, which fails the header check or
// the seal). Every greeting has one size, known to both ends: Gloo aborts a
// process whose posted buffer is smaller than what arrives. Empty when every
// greeting came.
std::string greet(c10d::ProcessGroupGloo& group, int rank, int world, int64_t run, int64_t attempt, const Seal* seal,
                  Clock::time_point deadline, const std::function<bool()>& stop) {
  MessageHeader header;
  header.run = run;
  header.kind = int64_t(MessageKind::greeting);
  header.exchange = attempt;
  header.bytes = sizeof(int64_t);
  constexpr int64_t kPlain = int64_t(MessageHeader::kBytes + sizeof(int64_t));
  const int64_t wire = kPlain + (seal ? int64_t(Seal::kOverhead) : 0);
  auto context = [&](int from, int to) { return seal_context({run, header.kind, attempt, from, to}); };
  std::vector<std::vector<torch::Tensor>> in(static_cast<size_t>(world)), out(static_cast<size_t>(world));
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  std::mutex posted;  // the watchdog aborts what has been posted so far
  try {
    Ticker watchdog(std::chrono::milliseconds(50), [&] {
      if (!stop()) return false;
      std::lock_guard<std::mutex> lock(posted);
      for (auto& w : works) w->abort();
      return true;
    });
    {
      std::lock_guard<std::mutex> lock(posted);
      for (int m = 0; m < world; ++m) {
        if (m == rank) continue;
        in[size_t(m)] = {torch::empty({wire}, torch::kUInt8)};
        works.push_back(group.recv(in[size_t(m)], m, kGreetingTag));
      }
      for (int m = 0; m < world; ++m) {
        if (m == rank) continue;
        auto plain = torch::empty({kPlain}, torch::kUInt8);
        const auto words = header.words();
        std::memcpy(plain.data_ptr<uint8_t>(), words.data(), MessageHeader::kBytes);
        const int64_t index = rank;
        std::memcpy(plain.data_ptr<uint8_t>() + MessageHeader::kBytes, &index, sizeof(index));
        auto message = plain;
        if (seal) {
          message = torch::empty({wire}, torch::kUInt8);
          seal->seal(plain.data_ptr<uint8_t>(), size_t(kPlain), context(rank, m), message.data_ptr<uint8_t>());
        }
        out[size_t(m)] = {message};
        works.push_back(group.send(out[size_t(m)], m, kGreetingTag));
      }
    }
    for (int m = 0; m < world; ++m) {
      if (m == rank) continue;
      const size_t k = size_t(m < rank ? m : m - 1);
      if (!works[k]->wait(left_until(deadline))) return fmt::format("member {} did not greet over its pair", m);
      auto plain = in[size_t(m)][0];
      if (seal) {
        plain = torch::empty({kPlain}, torch::kUInt8);
        if (!seal->open(in[size_t(m)][0].data_ptr<uint8_t>(), size_t(kPlain), context(m, rank), plain.data_ptr<uint8_t>()))
          return fmt::format("member {}'s pair brought a greeting that failed its seal", m);
      }
      const auto got = MessageHeader::from_words(reinterpret_cast<const int64_t*>(plain.data_ptr<uint8_t>()));
      if (const auto problem = check_message_header(header, got); !problem.empty())
        return fmt::format("member {} did not greet over its pair: {}", m, problem);
      int64_t index = -1;
      std::memcpy(&index, plain.data_ptr<uint8_t>() + MessageHeader::kBytes, sizeof(index));
      if (index != m) return fmt::format("member {}'s pair brought the greeting of member {}", m, index);
    }
    for (size_t k = size_t(world - 1); k < works.size(); ++k) works[k]->wait(left_until(deadline));
  } catch (const std::exception& e) {
    return error_text(e);
  }
  return {};
}

// The address `owner` published for its pair with `other`, if it did. Gloo's
// rendezvous keys: "0/<member>" (device 0) holds a member's addresses for its
// pairs, in member order without itself, each starting with a
// sockaddr_storage; anything else is left alone.
std::optional<sockaddr_storage> pair_address(c10d::Store& rendezvous, int owner, int other, int world) {
  const auto name = fmt::format("0/{}", owner);
  if (!rendezvous.check({name})) return std::nullopt;
  const auto addresses = rendezvous.get(name);
  const size_t size = addresses.size() / size_t(world - 1), index = size_t(other > owner ? other - 1 : other);
  if (size < sizeof(sockaddr_storage) || (index + 1) * size > addresses.size()) return std::nullopt;
  sockaddr_storage address{};
  std::memcpy(&address, addresses.data() + index * size, sizeof(address));
  return address;
}

// After giving up on an attempt: connects to, and at once closes, every
// listening port a peer published for its pair with this member. A peer
// still waiting for this member to connect (Gloo's pair connect cannot be
// interrupted) thus stops waiting instead of waiting out the timeout.
void release_waiting_peers(c10d::Store& rendezvous, int rank, int world) {
  for (int peer = 0; peer < world; ++peer) {
    if (peer == rank) continue;
    const auto address = pair_address(rendezvous, peer, rank, world);
    if (!address) continue;
    const int fd = ::socket(address->ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) continue;
    const socklen_t size = address->ss_family == AF_INET6 ? sizeof(sockaddr_in6) : sizeof(sockaddr_in);
    if (::connect(fd, reinterpret_cast<const sockaddr*>(&*address), size) == 0 || errno == EINPROGRESS)
      wait_connected(fd, Clock::now() + std::chrono::milliseconds(200));
    ::close(fd);
  }
}

}  // namespace

GlooGroup join_gloo_group(const StorePtr& store, const WorkerEnv& env, const std::string& name, int rank, int world,
                          const std::string& bind, std::chrono::milliseconds timeout, const Seal* seal,
                          const std::function<bool()>& abandon) {
  // The store cannot list keys, so keys under a secret prefix can be neither
  // found nor forged by a process without the token: it cannot join the run.
  const auto start = Clock::now(), deadline = start + timeout;
  const auto given_up = [&] { return abandon && abandon(); };
  std::string why;
  // A member that gives the group up (another is gone) says so for every
  // attempt: the others, failing the attempt with it, would otherwise wait
  // for it through their next one (peer_timeout).
  const auto group_scope = run_scope(store, env.token, name + "/pg");
  const auto abandoned_by_another = [&] {
    return std::runtime_error(fmt::format("group {} (member {} of {}) given up: another member gave it up (a member "
                                          "is gone)",
                                          name, rank, world));
  };
  int attempt = 0;
  for (; attempt < kGroupAttempts && left_until(deadline).count() > 0; ++attempt) {
    if (attempt > 0 && group_scope->check({"abandoned"})) throw abandoned_by_another();
    // Each attempt is a group of its own name: fresh ports, fresh keys. An
    // attempt fails for all as soon as one member says so ("failed"), and
    // succeeds for all once every member has said "ok"; a member that said
    // ok never says failed, so the two cannot both happen.
    const auto tried = fmt::format("{}/pg/{}", name, attempt);
    const auto verdicts = run_scope(store, env.token, tried + "/verdict");
    const auto rendezvous = run_scope(store, env.token, tried);
    // Set where stop() is asked (on this thread, between the store's calls,
    // whose connection is not for two threads), read by the watchdog below.
    std::atomic<bool> stopped{false};
    const auto stop = [&] {
      if (given_up() || verdicts->check({"failed"})) stopped = true;
      return stopped.load();
    };
    bool said_ok = false;
    try {
      auto options = c10d::ProcessGroupGloo::Options::create(left_until(deadline));
      // A device of its own: Gloo's one listener per device names incoming
      // connections by a sequence number, and one a stranger (or a failed
      // try's knock) sent it breaks every later try on that device.
      options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname(bind));
      options->threads = 2;
      const auto group = c10::make_intrusive<c10d::ProcessGroupGloo>(abandonable(rendezvous, stop), rank, world, options);
      const auto problem = greet(*group, rank, world, run_id_of(env.token), attempt, seal, deadline, stop);
      if (!problem.empty()) throw std::runtime_error(problem);
      verdicts->set(fmt::format("ok/{}", rank), std::vector<uint8_t>{1});
      said_ok = true;
      std::vector<std::string> everyone;
      for (int m = 0; m < world; ++m) everyone.push_back(fmt::format("ok/{}", m));
      abandonable(verdicts, stop)->wait(everyone, left_until(deadline));
      return group;
    } catch (const std::exception& e) {
      why = error_text(e);
      const bool gone = given_up();
      if (!said_ok) {
        if (gone) group_scope->set("abandoned", std::vector<uint8_t>{1});  // before "failed": seen with it
        verdicts->set("failed", std::vector<uint8_t>{1});
        release_waiting_peers(*rendezvous, rank, world);
      }
      if (gone)
        throw std::runtime_error(fmt::format("group {} (member {} of {}) given up after {:.0f} s: a member is gone "
                                             "(declared dead or its heartbeat silent)",
                                             name, rank, world, std::chrono::duration<double>(Clock::now() - start).count()));
      if (attempt + 1 < kGroupAttempts && left_until(deadline).count() > 0)
        spdlog::warn("group {} (member {} of {}), try {}: {}; forming it again on fresh ports", name, rank, world,
                     attempt + 1, why);
    }
  }
  throw std::runtime_error(fmt::format(
      "could not join the run at {} as worker {} ({} {} of {}) within {}s ({} tries): a member did not come (it "
      "died, or is unreachable at its bind address: behind NAT or a firewall, run `noloco serve` on a public machine "
      "and give every worker its NOLOCO_RELAY), NOLOCO_RUN_TOKEN differs, or a process that is not a member takes "
      "the group's connections: {}",
      store_address(env), env.rank, name, rank, world, timeout.count() / 1000, attempt, why));
}

}  // namespace noloco
