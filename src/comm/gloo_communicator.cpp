#include "comm/gloo_communicator.h"

#include "comm/heartbeat.h"

#include <algorithm>
#include <condition_variable>
#include <mutex>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <random>
#include <stdexcept>
#include <thread>

#include <fmt/format.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

namespace noloco {

namespace {

using Clock = std::chrono::steady_clock;

double since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// The store namespace for deaths and member snapshots of one group of the run with `token`.
c10::intrusive_ptr<c10d::Store> membership_store(const c10::intrusive_ptr<c10d::Store>& store, const std::string& token,
                                                 const std::string& group) {
  return c10::make_intrusive<c10d::PrefixStore>("noloco/" + token + "/" + group + "/members", store);
}

std::string read_or_empty(c10d::Store& store, const std::string& key) {
  if (!store.check({key})) return "";
  const auto bytes = store.get(key);
  return {bytes.begin(), bytes.end()};
}

std::vector<uint8_t> bytes_of(const std::string& s) { return {s.begin(), s.end()}; }

// Comma-separated lists under one key each ("dead", "incarnations",
// "rejoin", "finished"), changed atomically with compareSet, so reading a
// whole list costs one store round trip however many replicas there are.
std::vector<std::string> list_items(const std::string& text) {
  std::vector<std::string> items;
  for (size_t pos = 0; pos < text.size();) {
    const size_t comma = text.find(',', pos);
    if (comma == std::string::npos) break;
    if (comma > pos) items.push_back(text.substr(pos, comma - pos));
    pos = comma + 1;
  }
  return items;
}

bool list_has(const std::string& text, const std::string& item) {
  return ("," + text).find("," + item + ",") != std::string::npos;
}

void append_item(c10d::Store& store, const std::string& key, const std::string& item) {
  std::string current = read_or_empty(store, key);
  while (!list_has(current, item)) {
    const auto result = store.compareSet(key, bytes_of(current), bytes_of(current + item + ","));
    current.assign(result.begin(), result.end());
  }
}

void remove_item(c10d::Store& store, const std::string& key, const std::string& item) {
  std::string current = read_or_empty(store, key);
  while (list_has(current, item)) {
    std::string wanted = "," + current;
    wanted.erase(wanted.find("," + item + ","), item.size() + 1);
    const auto result = store.compareSet(key, bytes_of(current), bytes_of(wanted.substr(1)));
    current.assign(result.begin(), result.end());
  }
}

void add_dead(c10d::Store& members, int rank) { append_item(members, "dead", std::to_string(rank)); }

// "r.g" items: replica r is in its g-th incarnation (the latest one listed).
std::map<int, int> parse_incarnations(const std::string& text) {
  std::map<int, int> out;
  for (const auto& item : list_items(text)) {
    const auto dot = item.find('.');
    const int r = std::stoi(item.substr(0, dot)), g = std::stoi(item.substr(dot + 1));
    out[r] = std::max(out[r], g);
  }
  return out;
}

constexpr int64_t kExchangeMagic = 0x6e6f6c6f636fLL;
constexpr int64_t kStateMagic = 0x6e6f6c6f7374LL;

int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  if (!v || !*v) return fallback;
  char* end = nullptr;
  const long x = std::strtol(v, &end, 10);
  if (*end != '\0' || x < 0 || x > 1 << 30) throw std::invalid_argument(fmt::format("{}='{}' is not a valid number", name, v));
  return int(x);
}

}  // namespace

bool worker_env_from_environment(WorkerEnv& env) {
  if (!std::getenv("RANK")) return false;
  env.rank = env_int("RANK", 0);
  env.world = env_int("WORLD_SIZE", 1);
  env.local_rank = env_int("LOCAL_RANK", 0);
  if (const char* a = std::getenv("MASTER_ADDR")) env.master_addr = a;
  env.master_port = env_int("MASTER_PORT", 29500);
  const char* token = std::getenv("NOLOCO_RUN_TOKEN");
  if (!token || !*token)
    throw std::invalid_argument("NOLOCO_RUN_TOKEN is not set: give every worker of the run the same secret token");
  env.token = token;
  const char* agent = std::getenv("TORCHELASTIC_USE_AGENT_STORE");
  env.agent_store = agent && std::string(agent) == "True";
  if (env.world < 1 || env.rank >= env.world)
    throw std::invalid_argument(fmt::format("RANK={} is outside WORLD_SIZE={}", env.rank, env.world));
  return true;
}

c10::intrusive_ptr<c10d::Store> connect_store(const WorkerEnv& env, std::chrono::milliseconds timeout) {
  c10d::TCPStoreOptions opts;
  opts.port = uint16_t(env.master_port);
  opts.isServer = env.rank == 0 && !env.agent_store;
  opts.numWorkers = c10::nullopt;
  opts.waitWorkers = false;
  opts.timeout = timeout;
  return c10::make_intrusive<c10d::TCPStore>(env.master_addr, opts);
}

c10::intrusive_ptr<c10d::ProcessGroupGloo> join_process_group(const c10::intrusive_ptr<c10d::Store>& store,
                                                              const WorkerEnv& env, const std::string& group,
                                                              int rank, int world, const std::string& bind,
                                                              std::chrono::milliseconds timeout) {
  // The store cannot list keys, so keys under a secret prefix can be neither
  // found nor forged by a process without the token: it cannot join the run.
  auto prefixed = c10::make_intrusive<c10d::PrefixStore>("noloco/" + env.token + "/" + group + "/pg", store);
  auto options = c10d::ProcessGroupGloo::Options::create(timeout);
  options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname(bind));
  options->threads = 2;
  try {
    return c10::make_intrusive<c10d::ProcessGroupGloo>(prefixed, rank, world, options);
  } catch (const std::exception& e) {
    throw std::runtime_error(fmt::format(
        "could not join the run at {}:{} as worker {} ({} {} of {}) within {}s (wrong NOLOCO_RUN_TOKEN, or the other "
        "workers are gone): {}",
        env.master_addr, env.master_port, env.rank, group, rank, world, timeout.count() / 1000,
        std::string(e.what()).substr(0, std::string(e.what()).find('\n'))));
  }
}

GlooCommunicator::GlooCommunicator(const c10::intrusive_ptr<c10d::Store>& store, const WorkerEnv& env,
                                   const std::string& group, int rank, int world, const std::string& bind,
                                   std::chrono::milliseconds timeout, std::chrono::milliseconds heartbeat_timeout)
    : rank_(rank), world_(world), timeout_(timeout), heartbeat_timeout_(heartbeat_timeout), store_(store), env_(env), group_(group), bind_(bind) {
  membership_ = membership_store(store, env.token, group);
  run_id_ = run_id_of(env.token);
  incarnation_ = int(membership_->add(fmt::format("started/{}", rank), 1)) - 1;
  if (incarnation_ == 0) pg_ = join(group_, rank_, world_, timeout_);
}

c10::intrusive_ptr<c10d::ProcessGroupGloo> GlooCommunicator::join(const std::string& name, int rank, int world,
                                                                  std::chrono::milliseconds timeout) {
  return join_process_group(store_, env_, name, rank, world, bind_, timeout);
}

std::string check_message_header(const MessageHeader& expected, const MessageHeader& got) {
  if (got.magic != expected.magic) return "not a noloco message";
  if (got.run != expected.run) return "message from another run (token mismatch)";
  if (got.exchange != expected.exchange)
    return fmt::format("message for exchange {}, expected {}", got.exchange, expected.exchange);
  if (got.numel != expected.numel) return fmt::format("message of {} elements, expected {}", got.numel, expected.numel);
  if (got.dtype != expected.dtype) return fmt::format("message of dtype {}, expected {}", got.dtype, expected.dtype);
  return "";
}

void declare_dead(const c10::intrusive_ptr<c10d::Store>& store, const std::string& token, const std::string& group,
                  int rank) {
  add_dead(*membership_store(store, token, group), rank);
}

std::vector<int> GlooCommunicator::members(int64_t outer_step) {
  return agreed_members(fmt::format("snapshot/{}", outer_step));
}

std::vector<int> GlooCommunicator::agreed_members(const std::string& key) {
  // The first replica to reach this outer step writes the snapshot; everyone
  // else reads that one, so all agree even though deaths are noticed at
  // different moments. A death noticed too late for a snapshot costs only
  // its partner a lone outer step. Entries are "r" or "r.g" (incarnation g > 0).
  std::string text = read_or_empty(*membership_, key);
  if (text.empty()) {
    const std::string dead = read_or_empty(*membership_, "dead");
    const auto incarnations = parse_incarnations(read_or_empty(*membership_, "incarnations"));
    std::string alive;
    for (int r = 0; r < world_; ++r) {
      if (list_has(dead, std::to_string(r))) continue;
      const auto g = incarnations.find(r);
      alive += g == incarnations.end() || g->second == 0 ? fmt::format("{},", r) : fmt::format("{}.{},", r, g->second);
    }
    const auto agreed = membership_->compareSet(key, {}, bytes_of(alive));
    text.assign(agreed.begin(), agreed.end());
  }
  incarnation_of_.clear();
  std::vector<int> out;
  for (const auto& item : list_items(text)) {
    const auto dot = item.find('.');
    const int r = std::stoi(item.substr(0, dot));
    const int g = dot == std::string::npos ? 0 : std::stoi(item.substr(dot + 1));
    if (r == rank_ && g != incarnation_) continue;  // an earlier incarnation of this replica
    incarnation_of_[r] = g;
    out.push_back(r);
  }
  if (std::find(out.begin(), out.end(), rank_) == out.end())
    remove_item(*membership_, "dead", std::to_string(rank_));  // alive after all: back in later snapshots
  std::sort(out.begin(), out.end());
  return out;
}

int64_t run_id_of(const std::string& token) {
  return int64_t(std::hash<std::string>{}(token) & 0x7fffffffffffffffull);
}

std::string new_run_token() {
  std::random_device rd;
  return fmt::format("{:08x}{:08x}{:08x}{:08x}", rd(), rd(), rd(), rd());
}

GlooCommunicator::~GlooCommunicator() {
  if (releasing_.joinable()) releasing_.join();
}

void GlooCommunicator::release(c10::intrusive_ptr<c10d::ProcessGroupGloo> pg) {
  if (releasing_.joinable()) releasing_.join();  // the previous one: long done unless exchanges are back to back
  releasing_ = std::thread([pg = std::move(pg)]() mutable { pg.reset(); });
}

namespace {

void all_reduce_mean_over(c10d::ProcessGroupGloo& pg, torch::Tensor& t, int world, std::chrono::milliseconds timeout,
                          CommStats& s) {
  const auto start = Clock::now();
  auto cpu = t.device().is_cpu() ? t : t.to(torch::kCPU);
  std::vector<torch::Tensor> tensors{cpu};
  pg.allreduce(tensors)->wait(timeout);
  cpu.div_(world);
  if (!t.device().is_cpu()) t.copy_(cpu);
  // A ring all-reduce sends and receives 2·(N−1)/N of the buffer per replica.
  const double share = 2.0 * double(world - 1) / double(world);
  s.bytes_sent += uint64_t(share * double(cpu.nbytes()));
  s.bytes_received += uint64_t(share * double(cpu.nbytes()));
  s.collectives += 1;
  const double dt = since(start);
  s.comm_seconds += dt;
  s.wait_seconds += dt;  // a collective is one barrier: all of it is waiting on the slowest
}

// A process group formed for one purpose (an evaluation among the live replicas).
class GlooGroup final : public Communicator {
 public:
  GlooGroup(c10::intrusive_ptr<c10d::ProcessGroupGloo> pg, int rank, int world, std::chrono::milliseconds timeout)
      : pg_(std::move(pg)), rank_(rank), world_(world), timeout_(timeout) {}
  int rank() const override { return rank_; }
  int world() const override { return world_; }
  void all_reduce_mean(torch::Tensor& t) override { all_reduce_mean_over(*pg_, t, world_, timeout_, charge()); }
  torch::Tensor group_mean(const torch::Tensor&, const std::vector<int>&, int64_t, std::vector<int>*) override {
    throw std::logic_error("an evaluation group only does collectives");
  }

 private:
  c10::intrusive_ptr<c10d::ProcessGroupGloo> pg_;
  int rank_, world_;
  std::chrono::milliseconds timeout_;
};

}  // namespace

void GlooCommunicator::all_reduce_mean(torch::Tensor& t) {
  if (!pg_) throw std::runtime_error("a restarted worker is not part of the run-wide group");
  all_reduce_mean_over(*pg_, t, world_, timeout_, charge());
}

std::unique_ptr<Communicator> GlooCommunicator::live_group(int64_t step) {
  const auto members = agreed_members(fmt::format("evaluation/{}", step));
  const auto me = std::find(members.begin(), members.end(), rank_);
  if (me == members.end()) return nullptr;
  std::string name = fmt::format("{}/evaluation/{}/", group_, step);
  for (int r : members) name += fmt::format("{}.{}_", r, incarnation_of_[r]);
  const int index = int(me - members.begin()), size = int(members.size());
  return std::make_unique<GlooGroup>(join(name, index, size, timeout_), index, size, timeout_);
}

std::vector<int> GlooCommunicator::present_peers(const std::string& key, const std::vector<int>& group,
                                                 std::vector<int>* late) {
  // Each member adds 1 to its own counter under the exchange's key and blocks
  // until every peer's counter exists: event-driven, so pairs meet as soon as
  // both are there. A watchdog on its own store connection adds 2 for a peer
  // that is declared dead meanwhile or has not come within the timeout, which
  // wakes the wait. A counter of exactly 1 means "came, and not given up";
  // a member that finds more on arriving was given up and averages alone.
  // (Counters, not compareSet: the store wakes waiters on add, not on compareSet.)
  auto here = [&](int r) { return fmt::format("{}/here/{}", key, r); };
  std::vector<int> peers;
  for (int peer : group)
    if (peer != rank_) peers.push_back(peer);
  *late = {};
  if (membership_->add(here(rank_), 1) != 1) return {};
  if (!watch_) {
    c10d::TCPStoreOptions opts;
    opts.port = uint16_t(env_.master_port);
    opts.isServer = false;
    opts.timeout = timeout_;
    watch_raw_ = c10::make_intrusive<c10d::TCPStore>(env_.master_addr, opts);
    watch_ = membership_store(watch_raw_, env_.token, group_);
  }
  std::vector<std::string> keys;
  for (int peer : peers) keys.push_back(here(peer));
  if (!membership_->check(keys)) {
    std::mutex mutex;
    std::condition_variable wake;
    bool done = false;
    std::thread watchdog([&] {
      const auto deadline = Clock::now() + timeout_;
      // Workers are laid out replica-major: this group's member r is worker r·stride + offset.
      const int stride = std::max(1, env_.world / world_), offset = env_.rank % stride;
      HeartbeatWatch beats(watch_raw_, env_.token);
      auto last_beat_check = Clock::now();
      std::unique_lock<std::mutex> lock(mutex);
      while (!wake.wait_for(lock, std::chrono::milliseconds(20), [&] { return done; })) {
        const auto dead = read_or_empty(*watch_, "dead");
        const bool check_beats = Clock::now() - last_beat_check > std::chrono::seconds(1);
        if (check_beats) last_beat_check = Clock::now();
        for (int peer : peers) {
          bool gone = list_has(dead, std::to_string(peer)) || Clock::now() > deadline;
          if (check_beats)
            gone |= beats.silent_seconds(peer * stride + offset) * 1000 > double(heartbeat_timeout_.count());
          if (gone && !watch_->check({here(peer)})) watch_->add(here(peer), 2);
        }
      }
    });
    auto stop = [&] {
      {
        std::lock_guard<std::mutex> lock(mutex);
        done = true;
      }
      wake.notify_one();
      watchdog.join();
    };
    try {
      membership_->wait(keys, timeout_ + std::chrono::seconds(30));
    } catch (...) {
      stop();
      throw;
    }
    stop();
  }
  std::vector<int> present;
  for (int peer : peers) (membership_->add(here(peer), 0) == 1 ? present : *late).push_back(peer);
  return present;
}

torch::Tensor GlooCommunicator::group_mean(const torch::Tensor& payload, const std::vector<int>& group,
                                           int64_t exchange, std::vector<int>* arrived) {
  const auto start = Clock::now();
  auto& s = charge();
  auto local = payload.device().is_cpu() ? payload.contiguous() : payload.to(torch::kCPU);
  std::vector<int> counted{rank_};
  std::map<int, torch::Tensor> inbox;
  // Who takes part, by name and incarnation, so an exchange never pairs with
  // a stale process or a stale rendezvous.
  std::string key = fmt::format("x/{}/", exchange);
  for (int r : group) key += fmt::format("{}.{}-", r, incarnation_of_.count(r) ? incarnation_of_[r] : 0);
  std::vector<int> late;
  const auto wait_start = Clock::now();
  const auto present = group.size() > 1 ? present_peers(key, group, &late) : std::vector<int>{};
  for (int peer : late) {
    try {
      add_dead(*membership_, peer);
    } catch (const std::exception&) {
    }
  }
  if (!present.empty()) {
    std::vector<int> members = present;
    members.push_back(rank_);
    std::sort(members.begin(), members.end());
    auto local_rank = [&](int r) { return int(std::find(members.begin(), members.end(), r) - members.begin()); };
    std::string name = group_ + "/" + key;
    for (int r : members) name += fmt::format("{}_", r);
    const MessageHeader mine{kExchangeMagic, run_id_, exchange, local.numel(), int64_t(local.scalar_type())};
    const auto my_header = torch::tensor({mine.magic, mine.run, mine.exchange, mine.numel, mine.dtype}, torch::kInt64);
    try {
      auto pg = join(name, local_rank(rank_), int(members.size()), timeout_);  // ~10 ms on loopback
      std::vector<c10::intrusive_ptr<c10d::Work>> sends;
      std::map<int, torch::Tensor> headers;
      std::vector<std::pair<int, c10::intrusive_ptr<c10d::Work>>> header_recvs;
      for (int peer : present) {
        std::vector<torch::Tensor> h{my_header}, out{local};
        sends.push_back(pg->send(h, local_rank(peer), 0));
        sends.push_back(pg->send(out, local_rank(peer), 1));
        headers[peer] = torch::empty({5}, torch::kInt64);
        std::vector<torch::Tensor> in{headers[peer]};
        header_recvs.emplace_back(peer, pg->recv(in, local_rank(peer), 0));
      }
      for (auto& [peer, work] : header_recvs) {
        try {
          work->wait(timeout_);
          const auto* h = headers[peer].data_ptr<int64_t>();
          const auto problem = check_message_header(mine, MessageHeader{h[0], h[1], h[2], h[3], h[4]});
          if (!problem.empty()) {
            std::fprintf(stderr, "noloco[worker %d]: rejected a message from worker %d: %s\n", rank_, peer,
                         problem.c_str());
            continue;
          }
          inbox[peer] = torch::empty_like(local);
          std::vector<torch::Tensor> in{inbox[peer]};
          pg->recv(in, local_rank(peer), 1)->wait(timeout_);
          counted.push_back(peer);
          s.bytes_received += local.nbytes();
        } catch (const std::exception&) {
          inbox.erase(peer);  // died during the exchange: average without it, and tell the others
          add_dead(*membership_, peer);
        }
      }
      s.wait_seconds += since(wait_start);
      for (size_t i = 0; i < sends.size(); ++i) {
        try {
          sends[i]->wait(timeout_);
          if (i % 2 == 1) {  // the payload; headers (40 bytes) are not counted as training traffic
            s.bytes_sent += local.nbytes();
            s.messages += 1;
          }
        } catch (const std::exception&) {
        }
      }
      // Tearing a Gloo group down takes ~20 ms (its I/O loop winds down): off the training path.
      release(std::move(pg));
    } catch (const std::exception& e) {
      // The group could not form (a member died after announcing itself): average alone.
      std::fprintf(stderr, "noloco[worker %d]: exchange %lld fell back to a lone outer step: %s\n", rank_,
                   static_cast<long long>(exchange), std::string(e.what()).substr(0, 160).c_str());
      counted.assign(1, rank_);
      inbox.clear();
      s.wait_seconds += since(wait_start);
    }
  } else {
    s.wait_seconds += since(wait_start);
  }
  std::sort(counted.begin(), counted.end());
  auto sum = torch::zeros(local.sizes(), torch::kFloat32);
  for (int r : counted) sum.add_(r == rank_ ? local : inbox.at(r));
  sum.div_(double(counted.size()));
  if (arrived) *arrived = counted;
  s.comm_seconds += since(start);
  return payload.device().is_cpu() ? sum : sum.to(payload.device());
}

PeerState GlooCommunicator::receive_state(int64_t numel) {
  const std::string me = fmt::format("{}.{}", rank_, incarnation_);
  append_item(*membership_, "rejoin", me);
  // A live replica claims the request at its next outer step; until then,
  // make sure one is left that could.
  const auto deadline = Clock::now() + std::max(timeout_, std::chrono::milliseconds(600000));
  while (!membership_->check({"donor/" + me})) {
    const auto dead = read_or_empty(*membership_, "dead"), finished = read_or_empty(*membership_, "finished");
    bool anyone = false;
    for (int r = 0; r < world_; ++r)
      anyone |= r != rank_ && !list_has(dead, std::to_string(r)) && !list_has(finished, std::to_string(r));
    if (!anyone) throw std::runtime_error("no live replica is left to rejoin from");
    if (Clock::now() > deadline) throw std::runtime_error("no live replica handed over its state within 600 s");
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  const auto donor_bytes = membership_->get("donor/" + me);
  PeerState state;
  state.donor = std::stoi(std::string(donor_bytes.begin(), donor_bytes.end()));
  auto pg = join(group_ + "/rejoin/" + me, 1, 2, timeout_);
  auto header = torch::empty({6}, torch::kInt64);
  std::vector<torch::Tensor> h{header};
  pg->recv(h, 0, 0)->wait(timeout_);
  const auto* v = header.data_ptr<int64_t>();
  if (v[0] != kStateMagic || v[1] != run_id_ || v[4] != numel)
    throw std::runtime_error(fmt::format("rejected the state offered by worker {}: {}", state.donor,
                                         v[0] != kStateMagic ? "not a noloco state message"
                                         : v[1] != run_id_   ? "from another run (token mismatch)"
                                                             : fmt::format("{} values, expected {}", v[4], numel)));
  state.step = v[2];
  state.adam_steps = v[3];
  state.values = torch::empty({numel}, torch::kFloat32);
  std::vector<torch::Tensor> in{state.values};
  pg->recv(in, 0, 1)->wait(timeout_);
  charge().bytes_received += state.values.nbytes();
  // Ready: later snapshots include this incarnation.
  append_item(*membership_, "incarnations", me);
  remove_item(*membership_, "dead", std::to_string(rank_));
  return state;
}

std::vector<int> GlooCommunicator::serve_rejoins(int64_t step, int64_t adam_steps,
                                                 const std::function<torch::Tensor()>& pack) {
  std::vector<int> served;
  for (const auto& request : list_items(read_or_empty(*membership_, "rejoin"))) {
    if (!seen_requests_.insert(request).second) continue;
    const int who = std::stoi(request.substr(0, request.find('.')));
    if (who == rank_) continue;
    const auto mine = std::to_string(rank_);
    const auto claim = membership_->compareSet("donor/" + request, {}, bytes_of(mine));
    if (std::string(claim.begin(), claim.end()) != mine) continue;  // another replica serves it
    const auto start = Clock::now();
    try {
      auto values = pack().to(torch::kCPU).to(torch::kFloat32).contiguous();
      auto pg = join(group_ + "/rejoin/" + request, 0, 2, timeout_);
      auto header = torch::tensor({kStateMagic, run_id_, step, adam_steps, values.numel(), int64_t(rank_)}, torch::kInt64);
      std::vector<torch::Tensor> h{header}, out{values};
      pg->send(h, 1, 0)->wait(timeout_);
      pg->send(out, 1, 1)->wait(timeout_);
      charge().bytes_sent += values.nbytes();
      charge().messages += 1;
      served.push_back(who);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "noloco[worker %d]: could not hand over state to worker %d: %s\n", rank_, who,
                   std::string(e.what()).substr(0, 160).c_str());
    }
    charge().comm_seconds += since(start);
  }
  return served;
}

void GlooCommunicator::finish() { append_item(*membership_, "finished", std::to_string(rank_)); }

}  // namespace noloco
