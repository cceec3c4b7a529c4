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

#include "comm/store/abandonable_store.h"
#include "comm/transport/framed.h"
#include "comm/link/socket_io.h"
#include "comm/store/run_keys.h"
#include "comm/store/store.h"
#include "comm/transport/seal.h"
#include "comm/transport/ticker.h"
#include "util/error_text.h"

namespace noloco {

namespace {

using Clock = std::chrono::steady_clock;

// Above every tag an exchange uses (its number modulo 2^29, times framed_tags(1)).
constexpr int kGreetingTag = 1 << 30;

std::chrono::milliseconds left_until(Clock::time_point deadline) {
  return std::max(std::chrono::milliseconds(0),
                  std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()));
}

// Every member sends every other its own index over their pair, and checks
// what comes back: a pair that a stranger took gets nothing (or garbage,
// which fails the header check or the seal). Empty when every greeting came.
std::string greet(c10d::ProcessGroupGloo& group, int rank, int world, int64_t run, int64_t attempt, const Seal* seal,
                  Clock::time_point deadline, const std::function<bool()>& stop) {
  MessageHeader header;
  header.run = run;
  header.kind = int64_t(MessageKind::greeting);
  header.exchange = attempt;
  header.bytes = sizeof(int64_t);
  std::vector<FramedReceive> greetings;
  std::vector<FramedSend> sends;
  greetings.reserve(size_t(world));
  sends.reserve(size_t(world));
  std::mutex posted;  // the watchdog aborts what has been posted so far
  try {
    Ticker watchdog(std::chrono::milliseconds(50), [&] {
      if (!stop()) return false;
      std::lock_guard<std::mutex> lock(posted);
      for (auto& g : greetings) g.abort();
      for (auto& s : sends) s.abort();
      return true;
    });
    {
      std::lock_guard<std::mutex> lock(posted);
      for (int m = 0; m < world; ++m)
        if (m != rank)
          greetings.emplace_back(group, m, kGreetingTag, header,
                                 std::vector<torch::Tensor>{torch::empty({1}, torch::kInt64)}, /*eager=*/true, seal);
      for (int m = 0; m < world; ++m)
        if (m != rank)
          sends.emplace_back(group, m, kGreetingTag, header, std::vector<torch::Tensor>{torch::tensor({int64_t(rank)})},
                             seal);
    }
    for (size_t i = 0; i < greetings.size(); ++i) {
      const int from = int(i) < rank ? int(i) : int(i) + 1;
      const auto delivery = greetings[i].wait(left_until(deadline));
      if (delivery != Delivery::received)
        return fmt::format("member {} did not greet over its pair: {}", from,
                           greetings[i].problem().empty() ? "not the expected message" : greetings[i].problem());
      if (greetings[i].parts()[0].item<int64_t>() != from)
        return fmt::format("member {}'s pair brought the greeting of member {}", from,
                           greetings[i].parts()[0].item<int64_t>());
    }
    for (auto& s : sends) s.wait(left_until(deadline));
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

std::shared_ptr<gloo::transport::Device> gloo_device(const std::string& bind) {
  return c10d::ProcessGroupGloo::createDeviceForHostname(bind);
}

GlooGroup join_gloo_group(const StorePtr& store, const WorkerEnv& env, const std::string& name, int rank, int world,
                          const std::shared_ptr<gloo::transport::Device>& device, std::chrono::milliseconds timeout,
                          const Seal* seal, const std::function<bool()>& abandon) {
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
      options->devices.push_back(device);
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
