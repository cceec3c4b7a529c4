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

// The key each member sets in a try's verdicts.
std::vector<std::string> every_member(std::string (*key_of)(int), int world) {
  std::vector<std::string> keys;
  for (int m = 0; m < world; ++m) keys.push_back(key_of(m));
  return keys;
}

std::chrono::milliseconds left_until(Clock::time_point deadline) {
  return std::max(std::chrono::milliseconds(0),
                  std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()));
}

// Every member sends every other its own index, under a header naming the
// run and the try, over their pair, and checks what comes back: a pair that
// a stranger took gets nothing (or garbage, which fails the header check or
// the seal). Every greeting has one size, known to both ends: Gloo aborts a
// process whose posted buffer is smaller than what arrives. Empty when every
// greeting came. `overdue` says when greetings have had their time: a pair
// whose connection a stranger holds brings none.
std::string greet(c10d::ProcessGroupGloo& group, int rank, int world, int64_t run, int64_t attempt, const Seal* seal,
                  Clock::time_point deadline, const std::function<bool()>& stop,
                  const std::function<bool()>& overdue) {
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
  std::atomic<bool> late{false};
  try {
    Ticker watchdog(std::chrono::milliseconds(50), [&] {
      if (!stop() && !(late = overdue())) return false;
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
      if (!works[k]->wait(left_until(deadline)) || late)
        return fmt::format("member {} did not greet over its pair{}", m,
                           late ? fmt::format(" within {} s of every member connecting (a process that is not a member "
                                              "may hold the pair's connection)",
                                              kGreetingGrace.count())
                                : "");
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

// After giving up on an attempt: makes, and at once closes, the connection
// each peer waits for from this member. A peer still waiting for it (Gloo's
// pair connect cannot be interrupted) thus fails its greeting at once instead
// of waiting out the timeout.
void release_waiting_peers(c10d::Store& rendezvous, int rank, int world) {
  for (int peer = 0; peer < world; ++peer) {
    if (peer == rank) continue;
    const auto name = fmt::format("0/{}", peer);
    if (!rendezvous.check({name})) continue;
    const auto entry = parse_gloo_rendezvous_entry(rendezvous.get(name), world);
    if (!entry) continue;
    const auto& address = entry->listener;
    const int fd = ::socket(address.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) continue;
    const socklen_t size = address.ss_family == AF_INET6 ? sizeof(sockaddr_in6) : sizeof(sockaddr_in);
    if ((::connect(fd, reinterpret_cast<const sockaddr*>(&address), size) == 0 || errno == EINPROGRESS) &&
        wait_connected(fd, Clock::now() + std::chrono::milliseconds(200))) {
      const uint64_t sequence = uint64_t(entry->sequence_from(rank));
      (void)::send(fd, &sequence, sizeof(sequence), MSG_NOSIGNAL | MSG_DONTWAIT);
    }
    ::close(fd);
  }
}

}  // namespace

std::optional<GlooRendezvousEntry> parse_gloo_rendezvous_entry(const std::vector<uint8_t>& bytes, int world) {
  // Gloo's tcp::Rank: size_t and hostname, size_t and the device's Address
  // (a sockaddr_storage, then its sequence number), then one ssize_t per member.
  size_t at = 0;
  const auto read_size = [&](size_t& out) {
    if (bytes.size() - at < sizeof(out)) return false;
    std::memcpy(&out, bytes.data() + at, sizeof(out));
    at += sizeof(out);
    return out <= bytes.size() - at;
  };
  size_t hostname = 0, address = 0;
  if (!read_size(hostname)) return std::nullopt;
  at += hostname;
  if (!read_size(address) || address < sizeof(sockaddr_storage)) return std::nullopt;
  GlooRendezvousEntry entry;
  std::memcpy(&entry.listener, bytes.data() + at, sizeof(entry.listener));
  at += address;
  const size_t numbers = bytes.size() - at;
  if (entry.listener.ss_family != AF_INET && entry.listener.ss_family != AF_INET6) return std::nullopt;
  if (numbers != 0 && numbers != size_t(world) * sizeof(int64_t)) return std::nullopt;
  entry.sequence.resize(numbers / sizeof(int64_t));
  if (numbers) std::memcpy(entry.sequence.data(), bytes.data() + at, numbers);
  return entry;
}

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
  const auto group_scope = run_scope(store, env.token, record::process_group(name));
  const auto abandoned_by_another = [&] {
    return std::runtime_error(fmt::format("group {} (member {} of {}) given up: another member gave it up (a member "
                                          "is gone)",
                                          name, rank, world));
  };
  int attempt = 0;
  for (; attempt < kGroupAttempts && left_until(deadline).count() > 0; ++attempt) {
    if (attempt > 0 && group_scope->check({record::group::kAbandoned})) throw abandoned_by_another();
    // Each attempt is a group of its own name: fresh ports, fresh keys. An
    // attempt fails for all as soon as one member says so ("failed"), and
    // succeeds for all once every member has said "ok"; a member that said
    // ok never says failed, so the two cannot both happen.
    const auto tried = record::group_try(name, attempt);
    const auto verdicts = run_scope(store, env.token, record::verdicts(tried));
    const auto rendezvous = run_scope(store, env.token, tried);
    // Set where stop() is asked (on this thread, between the store's calls,
    // whose connection is not for two threads), read by the watchdog below.
    std::atomic<bool> stopped{false};
    const auto stop = [&] {
      if (given_up() || verdicts->check({record::group::kFailed})) stopped = true;
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
      verdicts->set(record::group::connected(rank), std::vector<uint8_t>{1});
      std::optional<Clock::time_point> all_connected;
      const auto overdue = [&] {
        if (!all_connected && verdicts->check(every_member(record::group::connected, world))) all_connected = Clock::now();
        return all_connected && Clock::now() - *all_connected > kGreetingGrace;
      };
      const auto problem = greet(*group, rank, world, run_id_of(env.token), attempt, seal, deadline, stop, overdue);
      if (!problem.empty()) throw std::runtime_error(problem);
      verdicts->set(record::group::ok(rank), std::vector<uint8_t>{1});
      said_ok = true;
      abandonable(verdicts, stop)->wait(every_member(record::group::ok, world), left_until(deadline));
      return group;
    } catch (const std::exception& e) {
      why = error_text(e);
      const bool gone = given_up();
      if (!said_ok) {
        if (gone) group_scope->set(record::group::kAbandoned, std::vector<uint8_t>{1});  // before "failed": seen with it
        verdicts->set(record::group::kFailed, std::vector<uint8_t>{1});
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
      "died, or is unreachable at its bind address: Gloo connects members directly, so a replica's workers, and a "
      "ddp run's, must reach each other with no NAT or firewall between), NOLOCO_RUN_TOKEN differs, or a process "
      "that is not a member takes the group's connections: {}",
      store_address(env), env.rank, name, rank, world, timeout.count() / 1000, attempt, why));
}

}  // namespace noloco
