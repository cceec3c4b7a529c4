#include "comm/gloo_transport.h"

#include <algorithm>
#include <condition_variable>
#include <mutex>

#include <fmt/format.h>
#include <spdlog/spdlog.h>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "util/error_text.h"

namespace noloco {

namespace {

using Clock = std::chrono::steady_clock;

double since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

std::string members_key(const std::vector<Peer>& members) {
  std::string key;
  for (const auto& p : members) key += fmt::format("{}.{}_", p.rank, p.incarnation);
  return key;
}

torch::Tensor header_tensor(const MessageHeader& h) {
  const auto w = h.words();
  return torch::tensor(std::vector<int64_t>(w.begin(), w.end()), torch::kInt64);
}

CommStats all_reduce_mean_over(c10d::ProcessGroupGloo& pg, torch::Tensor& t, int world,
                               std::chrono::milliseconds timeout) {
  CommStats s;
  const auto start = Clock::now();
  auto cpu = t.device().is_cpu() ? t : t.to(torch::kCPU);
  std::vector<torch::Tensor> tensors{cpu};
  pg.allreduce(tensors)->wait(timeout);
  cpu.div_(world);
  if (!t.device().is_cpu()) t.copy_(cpu);
  // A ring all-reduce sends and receives 2·(N−1)/N of the buffer per member.
  const double share = 2.0 * double(world - 1) / double(world);
  s.bytes_sent += uint64_t(share * double(cpu.nbytes()));
  s.bytes_received += uint64_t(share * double(cpu.nbytes()));
  s.collectives += 1;
  const double dt = since(start);
  s.comm_seconds += dt;
  s.wait_seconds += dt;  // a collective is one barrier: all of it is waiting on the slowest
  return s;
}

std::vector<torch::Tensor> all_gather_over(c10d::ProcessGroupGloo& pg, const torch::Tensor& bytes, int world,
                                           std::chrono::milliseconds timeout, CommStats& s) {
  s = CommStats{};
  const auto start = Clock::now();
  std::vector<torch::Tensor> input{bytes.contiguous()};
  std::vector<std::vector<torch::Tensor>> output(1);
  for (int r = 0; r < world; ++r) output[0].push_back(torch::empty_like(input[0]));
  pg.allgather(output, input)->wait(timeout);
  // Each member's payload reaches the N−1 others once.
  s.bytes_sent += uint64_t(world - 1) * uint64_t(bytes.nbytes());
  s.bytes_received += uint64_t(world - 1) * uint64_t(bytes.nbytes());
  s.collectives += 1;
  const double dt = since(start);
  s.comm_seconds += dt;
  s.wait_seconds += dt;
  return output[0];
}

std::vector<torch::Tensor> all_to_all_over(c10d::ProcessGroupGloo& pg, const torch::Tensor& bytes, int world,
                                           std::chrono::milliseconds timeout, CommStats& s) {
  TORCH_CHECK(bytes.numel() % world == 0, "all_to_all needs equal chunks");
  s = CommStats{};
  const auto start = Clock::now();
  auto input = bytes.contiguous();
  auto output = torch::empty_like(input);
  std::vector<int64_t> equal;
  pg.alltoall_base(output, input, equal, equal)->wait(timeout);
  const uint64_t chunk = uint64_t(bytes.numel() / world);
  s.bytes_sent += uint64_t(world - 1) * chunk;
  s.bytes_received += uint64_t(world - 1) * chunk;
  s.collectives += 1;
  const double dt = since(start);
  s.comm_seconds += dt;
  s.wait_seconds += dt;
  return output.chunk(world);
}

// Collectives among a group formed for one purpose (an evaluation across the live replicas).
class GlooCollectives final : public Transport {
 public:
  GlooCollectives(GlooGroup pg, int rank, int world, std::chrono::milliseconds timeout)
      : pg_(std::move(pg)), rank_(rank), world_(world), timeout_(timeout) {}
  int rank() const override { return rank_; }
  int world() const override { return world_; }
  void all_reduce_mean(torch::Tensor& t) override { charge(all_reduce_mean_over(*pg_, t, world_, timeout_)); }
  std::vector<torch::Tensor> all_gather(const torch::Tensor& bytes) override {
    CommStats cost;
    auto out = all_gather_over(*pg_, bytes, world_, timeout_, cost);
    charge(cost);
    return out;
  }
  std::vector<torch::Tensor> all_to_all(const torch::Tensor& bytes) override {
    CommStats cost;
    auto out = all_to_all_over(*pg_, bytes, world_, timeout_, cost);
    charge(cost);
    return out;
  }
  ExchangeResult exchange(const ExchangeRequest&) override {
    throw std::logic_error("a collectives-only group does no point-to-point exchanges");
  }
  void send_state(const std::string&, const MessageHeader&, const torch::Tensor&) override {
    throw std::logic_error("a collectives-only group hands over no state");
  }
  torch::Tensor receive_state(const std::string&, const MessageHeader&) override {
    throw std::logic_error("a collectives-only group hands over no state");
  }
  std::unique_ptr<Transport> subgroup(const std::string&, const std::vector<Peer>&) override {
    throw std::logic_error("a collectives-only group has no subgroups");
  }

 private:
  GlooGroup pg_;
  int rank_, world_;
  std::chrono::milliseconds timeout_;
};

}  // namespace

std::shared_ptr<gloo::transport::Device> gloo_device(const std::string& bind) {
  return c10d::ProcessGroupGloo::createDeviceForHostname(bind);
}

GlooGroup join_gloo_group(const StorePtr& store, const WorkerEnv& env, const std::string& name, int rank, int world,
                          const std::shared_ptr<gloo::transport::Device>& device, std::chrono::milliseconds timeout) {
  // The store cannot list keys, so keys under a secret prefix can be neither
  // found nor forged by a process without the token: it cannot join the run.
  auto options = c10d::ProcessGroupGloo::Options::create(timeout);
  options->devices.push_back(device);
  options->threads = 2;
  try {
    return c10::make_intrusive<c10d::ProcessGroupGloo>(run_scope(store, env.token, name + "/pg"), rank, world,
                                                       options);
  } catch (const std::exception& e) {
    throw std::runtime_error(fmt::format(
        "could not join the run at {}:{} as worker {} ({} {} of {}) within {}s: a member did not come (it died, or "
        "is unreachable at its bind address), or NOLOCO_RUN_TOKEN differs: {}",
        env.master_addr, env.master_port, env.rank, name, rank, world, timeout.count() / 1000, error_text(e)));
  }
}

GlooTransport::GlooTransport(std::function<StorePtr()> connect, const WorkerEnv& env, std::string scope, Peer self,
                             int world, const std::string& bind, std::chrono::milliseconds timeout)
    : connect_(std::move(connect)),
      env_(env),
      scope_(std::move(scope)),
      self_(self),
      world_(world),
      timeout_(timeout),
      run_id_(run_id_of(env.token)),
      store_(connect_()),
      device_(gloo_device(bind)) {}

GlooTransport::~GlooTransport() {
  groups_.clear();
  if (releasing_.joinable()) releasing_.join();
}

GlooGroup GlooTransport::join(const std::string& name, int rank, int world) {
  return join_gloo_group(store_, env_, name, rank, world, device_, timeout_);
}

void GlooTransport::release(GlooGroup group) {
  std::lock_guard<std::mutex> lock(release_mutex_);
  if (releasing_.joinable()) releasing_.join();  // the previous teardown: long done unless exchanges are back to back
  releasing_ = std::thread([g = std::move(group)]() mutable { g.reset(); });
}

c10d::ProcessGroupGloo& GlooTransport::run_group() {
  if (self_.incarnation > 0) throw std::runtime_error("a restarted worker is not part of the run-wide group");
  if (!run_group_) run_group_ = join(scope_, self_.rank, world_);
  return *run_group_;
}

void GlooTransport::all_reduce_mean(torch::Tensor& t) { charge(all_reduce_mean_over(run_group(), t, world_, timeout_)); }

std::vector<torch::Tensor> GlooTransport::all_gather(const torch::Tensor& bytes) {
  CommStats cost;
  auto out = all_gather_over(run_group(), bytes, world_, timeout_, cost);
  charge(cost);
  return out;
}

std::vector<torch::Tensor> GlooTransport::all_to_all(const torch::Tensor& bytes) {
  CommStats cost;
  auto out = all_to_all_over(run_group(), bytes, world_, timeout_, cost);
  charge(cost);
  return out;
}

std::unique_ptr<Transport> GlooTransport::subgroup(const std::string& name, const std::vector<Peer>& members) {
  const auto me = std::find(members.begin(), members.end(), self_);
  if (me == members.end()) throw std::logic_error("subgroup without this member");
  const int index = int(me - members.begin()), size = int(members.size());
  // Its own store connection: an exchange may be meeting on store_ on another thread (overlap=true).
  auto group = join_gloo_group(connect_(), env_, scope_ + "/" + name + "/" + members_key(members), index, size, device_,
                               timeout_);
  return std::make_unique<GlooCollectives>(std::move(group), index, size, timeout_);
}

std::vector<Peer> GlooTransport::meet(const std::string& key, const std::vector<Peer>& peers,
                                      const std::function<bool(int)>& give_up, std::vector<int>* late,
                                      int64_t my_generation, std::map<int, int64_t>* generations) {
  // Each member adds 1 to its own counter under the exchange's key and blocks
  // until every peer's counter exists: event-driven, so members meet as soon
  // as all are there. A watchdog on its own store connection adds 2 for a
  // peer that is given up or has not come within the timeout, which wakes the
  // wait. A counter of exactly 1 means "came, and not given up"; a member
  // that finds more on arriving was given up and goes on alone.
  // (Counters, not compareSet: the store wakes waiters on add, not on compareSet.)
  const auto meetings = run_scope(store_, env_.token, scope_ + "/meet");
  auto here = [&](int r) { return fmt::format("{}/here/{}", key, r); };
  auto generation_key = [&](int r) { return fmt::format("{}/generation/{}", key, r); };
  const auto generation = std::to_string(my_generation);
  meetings->set(generation_key(self_.rank), std::vector<uint8_t>(generation.begin(), generation.end()));
  if (meetings->add(here(self_.rank), 1) != 1) return {};
  std::vector<std::string> keys;
  for (const auto& peer : peers) keys.push_back(here(peer.rank));
  if (!meetings->check(keys)) {
    if (!watch_) watch_ = connect_();
    const auto watch = run_scope(watch_, env_.token, scope_ + "/meet");
    std::mutex mutex;
    std::condition_variable wake;
    bool done = false;
    std::thread watchdog([&] {
      const auto deadline = Clock::now() + timeout_;
      std::unique_lock<std::mutex> lock(mutex);
      while (!wake.wait_for(lock, std::chrono::milliseconds(20), [&] { return done; })) {
        for (const auto& peer : peers) {
          if ((Clock::now() > deadline || give_up(peer.rank)) && !watch->check({here(peer.rank)}))
            watch->add(here(peer.rank), 2);
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
      meetings->wait(keys, timeout_ + std::chrono::seconds(30));
    } catch (...) {
      stop();
      throw;
    }
    stop();
  }
  std::vector<Peer> present;
  for (const auto& peer : peers) {
    if (meetings->add(here(peer.rank), 0) != 1) {
      late->push_back(peer.rank);
      continue;
    }
    present.push_back(peer);
    const auto value = meetings->get(generation_key(peer.rank));
    (*generations)[peer.rank] = std::stoll(std::string(value.begin(), value.end()));
  }
  return present;
}

ExchangeResult GlooTransport::exchange(const ExchangeRequest& request) {
  const auto start = Clock::now();
  CommStats s;
  ExchangeResult result;
  std::vector<Peer> peers;
  for (const auto& p : request.group)
    if (p.rank != self_.rank) peers.push_back(p);
  if (peers.empty()) return result;
  TORCH_CHECK(request.payload.scalar_type() == torch::kUInt8 && request.payload.is_contiguous() &&
                  request.header.bytes == request.payload.numel(),
              "exchange payloads are contiguous bytes described by their header");

  // Reuse the group of the last exchange among exactly these members, if
  // every one of them still holds the same one (the generation they announce).
  const std::string planned = members_key(request.group);
  auto cached = std::find_if(groups_.begin(), groups_.end(), [&](const CachedGroup& g) { return g.members == planned; });
  const int64_t my_generation = cached != groups_.end() ? cached->generation : 0;
  std::map<int, int64_t> generations;
  const auto present = meet(fmt::format("{}/{}", request.id, planned), peers, request.give_up, &result.lost,
                            my_generation, &generations);
  if (present.empty()) {
    s.wait_seconds += since(start);
    s.comm_seconds += since(start);
    charge(s);
    return result;
  }
  std::vector<Peer> members = present;
  members.push_back(self_);
  std::sort(members.begin(), members.end(), [](const Peer& a, const Peer& b) { return a.rank < b.rank; });
  auto index_of = [&](int rank) {
    return int(std::find_if(members.begin(), members.end(), [&](const Peer& p) { return p.rank == rank; }) -
               members.begin());
  };
  const bool whole = present.size() == peers.size();
  const bool reuse = whole && my_generation != 0 &&
                     std::all_of(present.begin(), present.end(),
                                 [&](const Peer& p) { return generations[p.rank] == my_generation; });
  auto drop_cached = [&] {
    if (cached == groups_.end()) return;
    release(std::move(cached->group));
    groups_.erase(cached);
    cached = groups_.end();
  };
  GlooGroup pg;
  try {
    if (reuse) {
      groups_.splice(groups_.begin(), groups_, cached);
      pg = cached->group;
    } else {
      // Named by this exchange, so that no member can ever meet a stale group.
      const int64_t generation = request.id + 1;
      pg = join(fmt::format("{}/p2p/{}/{}", scope_, members_key(members), generation), index_of(self_.rank),
                int(members.size()));
      if (whole) {
        drop_cached();
        groups_.push_front({planned, generation, pg});
        constexpr size_t kMaxGroups = 64;
        if (groups_.size() > kMaxGroups) {
          release(std::move(groups_.back().group));
          groups_.pop_back();
        }
        cached = groups_.begin();
      }
    }
  } catch (const std::exception& e) {
    // A member died after announcing itself: go on without any of them.
    spdlog::warn("exchange {} could not form its group; going on alone: {}", request.id, error_text(e));
    for (const auto& p : present) result.lost.push_back(p.rank);
    s.wait_seconds += since(start);
    s.comm_seconds += since(start);
    charge(s);
    return result;
  }

  // Every receive is posted before any send: on Gloo's one socket per pair,
  // a receive posted late makes the two directions take turns.
  const int tag = int(request.id % (int64_t(1) << 29)) * 2;
  auto expected = request.header;
  expected.run = run_id_;
  const auto my_header = header_tensor(expected);
  struct Incoming {
    Peer peer;
    torch::Tensor header, payload;
    c10::intrusive_ptr<c10d::Work> header_work, payload_work;
  };
  std::vector<Incoming> incoming;
  std::vector<c10::intrusive_ptr<c10d::Work>> sends;
  bool failed = false;
  try {
    for (const auto& p : present) {
      Incoming in{p, torch::empty({MessageHeader::kWords}, torch::kInt64), torch::empty_like(request.payload), {}, {}};
      std::vector<torch::Tensor> h{in.header}, d{in.payload};
      in.header_work = pg->recv(h, index_of(p.rank), tag);
      in.payload_work = pg->recv(d, index_of(p.rank), tag + 1);
      incoming.push_back(std::move(in));
    }
    for (const auto& p : present) {
      std::vector<torch::Tensor> h{my_header}, d{request.payload};
      sends.push_back(pg->send(h, index_of(p.rank), tag));
      sends.push_back(pg->send(d, index_of(p.rank), tag + 1));
    }
  } catch (const std::exception& e) {
    spdlog::warn("exchange {} failed to start: {}", request.id, error_text(e));
    failed = true;
  }
  for (auto& in : incoming) {
    try {
      in.header_work->wait(timeout_);
      in.payload_work->wait(timeout_);
      const auto problem = check_message_header(expected, MessageHeader::from_words(in.header.data_ptr<int64_t>()));
      if (!problem.empty()) {
        spdlog::error("rejected a message from worker {}: {}", in.peer.rank, problem);
        result.lost.push_back(in.peer.rank);
        continue;
      }
      result.received[in.peer.rank] = in.payload;
      s.bytes_received += uint64_t(in.payload.numel());
    } catch (const std::exception& e) {
      result.lost.push_back(in.peer.rank);  // died or timed out during the exchange: its pair is closed
      failed = true;
    }
  }
  s.wait_seconds += since(start);
  for (size_t i = 0; i < sends.size(); ++i) {
    try {
      sends[i]->wait(timeout_);
      if (i % 2 == 1) {  // the payload; headers (72 bytes) are not counted as training traffic
        s.bytes_sent += uint64_t(request.payload.numel());
        s.messages += 1;
      }
    } catch (const std::exception&) {
      failed = true;
    }
  }
  // A failed group is never used again (a timed-out Gloo pair stays closed);
  // one formed for part of the group is not kept either.
  if (!whole) {
    release(std::move(pg));
  } else if (failed) {
    pg.reset();
    drop_cached();
  }
  std::sort(result.lost.begin(), result.lost.end());
  s.comm_seconds += since(start);
  charge(s);
  return result;
}

void GlooTransport::send_state(const std::string& channel, const MessageHeader& header, const torch::Tensor& bytes) {
  const auto start = Clock::now();
  auto pg = join_gloo_group(connect_(), env_, scope_ + "/handover/" + channel, 0, 2, device_, timeout_);
  auto stamped = header;
  stamped.run = run_id_;
  auto h = header_tensor(stamped);
  std::vector<torch::Tensor> hv{h}, dv{bytes.contiguous()};
  pg->send(hv, 1, 0)->wait(timeout_);
  pg->send(dv, 1, 1)->wait(timeout_);
  CommStats cost;
  cost.bytes_sent = uint64_t(bytes.nbytes());
  cost.messages = 1;
  cost.comm_seconds = since(start);
  charge(cost);
  release(std::move(pg));
}

torch::Tensor GlooTransport::receive_state(const std::string& channel, const MessageHeader& expected) {
  const auto start = Clock::now();
  auto pg = join_gloo_group(connect_(), env_, scope_ + "/handover/" + channel, 1, 2, device_, timeout_);
  auto h = torch::empty({MessageHeader::kWords}, torch::kInt64);
  std::vector<torch::Tensor> hv{h};
  pg->recv(hv, 0, 0)->wait(timeout_);
  auto stamped = expected;
  stamped.run = run_id_;
  const auto problem = check_message_header(stamped, MessageHeader::from_words(h.data_ptr<int64_t>()));
  if (!problem.empty()) throw std::runtime_error("rejected the state offered to this worker: " + problem);
  auto bytes = torch::empty({expected.bytes}, torch::kUInt8);
  std::vector<torch::Tensor> dv{bytes};
  pg->recv(dv, 0, 1)->wait(timeout_);
  CommStats cost;
  cost.bytes_received = uint64_t(bytes.nbytes());
  cost.comm_seconds = since(start);
  charge(cost);
  release(std::move(pg));
  return bytes;
}

}  // namespace noloco
