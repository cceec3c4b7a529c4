#include "comm/transport/gloo_transport.h"

#include <algorithm>
#include <mutex>
#include <optional>

#include <fmt/format.h>
#include <spdlog/spdlog.h>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "comm/transport/framed.h"
#include "comm/transport/gloo_admission.h"
#include "comm/transport/seal.h"
#include "comm/transport/ticker.h"
#include "util/error_text.h"
#include "util/leave_signal.h"

namespace noloco {

std::vector<uint8_t> CollectiveSeal::context(int64_t kind, int64_t number, int from, int to) const {
  auto bytes = seal_context({run, kind, number, from, to});
  bytes.insert(bytes.end(), group.begin(), group.end());
  return bytes;
}

namespace {

using Clock = std::chrono::steady_clock;

double since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

std::string members_key(const std::vector<Peer>& members) {
  std::string key;
  for (const auto& p : members) key += fmt::format("{}.{}_", p.rank, p.incarnation);
  return key;
}

uint8_t* bytes_ptr(const torch::Tensor& t) { return static_cast<uint8_t*>(t.data_ptr()); }

enum CollectiveKind : int64_t { kGather = 1, kToAll = 2, kBroadcast = 3 };

// A meeting counter: 1 came, 2 (or 3) given up by a peer's watchdog, from
// kStaysAway up: said it will not come.
constexpr int64_t kStaysAway = 4;

// Member `rank`'s counter at the meeting `key`.
std::string arrival_key(const std::string& key, int rank) { return fmt::format("{}/here/{}", key, rank); }

torch::Tensor sealed_copy(const CollectiveSeal& sealing, const torch::Tensor& plain, const std::vector<uint8_t>& context) {
  auto sealed = torch::empty({int64_t(plain.nbytes() + Seal::kOverhead)}, torch::kUInt8);
  sealing.seal->seal(bytes_ptr(plain), plain.nbytes(), context, bytes_ptr(sealed));
  return sealed;
}

torch::Tensor opened(const CollectiveSeal& sealing, const torch::Tensor& sealed, const std::vector<uint8_t>& context,
                     int from, int64_t number) {
  auto plain = torch::empty({int64_t(sealed.nbytes() - Seal::kOverhead)}, torch::kUInt8);
  if (!sealing.seal->open(bytes_ptr(sealed), plain.nbytes(), context, bytes_ptr(plain)))
    throw std::runtime_error(fmt::format("the message of group member {} in collective {} of {} failed "
                                         "authentication (changed on the way, replayed, or sealed with another "
                                         "token): not used",
                                         from, number, sealing.group));
  return plain;
}

CommStats plain_all_reduce_mean_over(c10d::ProcessGroupGloo& pg, torch::Tensor& t, int world,
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
                                           std::chrono::milliseconds timeout, CommStats& s, CollectiveSeal& sealing) {
  s = CommStats{};
  const auto start = Clock::now();
  const int64_t number = sealing.count++;
  std::vector<torch::Tensor> input{bytes.contiguous()};
  if (sealing.seal) input[0] = sealed_copy(sealing, input[0], sealing.context(kGather, number, pg.getRank(), -1));
  std::vector<std::vector<torch::Tensor>> output(1);
  for (int r = 0; r < world; ++r) output[0].push_back(torch::empty_like(input[0]));
  pg.allgather(output, input)->wait(timeout);
  // Each member's payload reaches the N−1 others once.
  s.bytes_sent += uint64_t(world - 1) * uint64_t(input[0].nbytes());
  s.bytes_received += uint64_t(world - 1) * uint64_t(input[0].nbytes());
  if (sealing.seal)
    for (int r = 0; r < world; ++r)
      output[0][size_t(r)] = opened(sealing, output[0][size_t(r)], sealing.context(kGather, number, r, -1), r, number);
  s.collectives += 1;
  const double dt = since(start);
  s.comm_seconds += dt;
  s.wait_seconds += dt;
  return output[0];
}

std::vector<torch::Tensor> all_to_all_over(c10d::ProcessGroupGloo& pg, const torch::Tensor& bytes, int world,
                                           std::chrono::milliseconds timeout, CommStats& s, CollectiveSeal& sealing) {
  TORCH_CHECK(bytes.numel() % world == 0, "all_to_all needs equal chunks");
  s = CommStats{};
  const auto start = Clock::now();
  const int64_t number = sealing.count++;
  const int self = pg.getRank();
  auto input = bytes.contiguous();
  if (sealing.seal) {
    std::vector<torch::Tensor> sealed;
    const auto chunks = input.chunk(world);
    for (int to = 0; to < world; ++to)
      sealed.push_back(sealed_copy(sealing, chunks[size_t(to)], sealing.context(kToAll, number, self, to)));
    input = torch::cat(sealed);
  }
  auto output = torch::empty_like(input);
  std::vector<int64_t> equal;
  pg.alltoall_base(output, input, equal, equal)->wait(timeout);
  const uint64_t chunk = uint64_t(input.numel() / world);
  s.bytes_sent += uint64_t(world - 1) * chunk;
  s.bytes_received += uint64_t(world - 1) * chunk;
  auto incoming = output.chunk(world);
  if (sealing.seal)
    for (int from = 0; from < world; ++from)
      incoming[size_t(from)] =
          opened(sealing, incoming[size_t(from)], sealing.context(kToAll, number, from, self), from, number);
  s.collectives += 1;
  const double dt = since(start);
  s.comm_seconds += dt;
  s.wait_seconds += dt;
  return incoming;
}

CommStats broadcast_over(c10d::ProcessGroupGloo& pg, torch::Tensor& t, int root, int world,
                         std::chrono::milliseconds timeout, CollectiveSeal& sealing) {
  CommStats s;
  const auto start = Clock::now();
  const int64_t number = sealing.count++;
  const bool sending = pg.getRank() == root;
  auto plain = t.detach().to(torch::kCPU).contiguous();  // t itself where it is a contiguous CPU tensor
  auto bytes = plain.view(-1).view(torch::kUInt8);
  const auto context = sealing.context(kBroadcast, number, root, -1);
  auto wire = bytes;
  if (sealing.seal)
    wire = sending ? sealed_copy(sealing, bytes, context)
                   : torch::empty({bytes.numel() + int64_t(Seal::kOverhead)}, torch::kUInt8);
  std::vector<torch::Tensor> tensors{wire};
  c10d::BroadcastOptions options;
  options.rootRank = root;
  pg.broadcast(tensors, options)->wait(timeout);
  if (!sending) {
    if (sealing.seal) bytes.copy_(opened(sealing, wire, context, root, number));
    if (plain.data_ptr() != t.data_ptr()) t.copy_(plain);
  }
  // Counted as a tree would send it: the root's payload reaches the N−1 others once.
  (sending ? s.bytes_sent : s.bytes_received) += uint64_t(wire.nbytes()) * uint64_t(sending ? world - 1 : 1);
  s.collectives += 1;
  s.comm_seconds = s.wait_seconds = since(start);
  return s;
}

// Sealed, the mean cannot run inside Gloo's all-reduce (it adds the bytes it
// carries): it runs as a reduce-scatter through the sealed all-to-all, each
// member adding up its slice in rank order, and an all-gather of the slices.
// The same bytes on the wire per member as Gloo's ring, 2·(N−1)/N of the
// buffer, and the same result on every member.
CommStats all_reduce_mean_over(c10d::ProcessGroupGloo& pg, torch::Tensor& t, int world,
                               std::chrono::milliseconds timeout, CollectiveSeal& sealing) {
  if (!sealing.seal) return plain_all_reduce_mean_over(pg, t, world, timeout);
  const auto start = Clock::now();
  const auto flat = t.detach().to(torch::kCPU).contiguous().view(-1);
  const int64_t n = flat.numel(), slice = (n + world - 1) / world;
  auto padded = torch::zeros({slice * world}, flat.options());
  padded.narrow(0, 0, n).copy_(flat);
  CommStats scatter, gather;
  const auto parts = all_to_all_over(pg, padded.view(torch::kUInt8), world, timeout, scatter, sealing);
  auto own = torch::zeros({slice}, flat.options());
  for (const auto& part : parts) own.add_(part.view(flat.scalar_type()));
  own.div_(world);
  const auto slices = all_gather_over(pg, own.view(torch::kUInt8), world, timeout, gather, sealing);
  std::vector<torch::Tensor> values;
  for (const auto& b : slices) values.push_back(b.view(flat.scalar_type()));
  t.copy_(torch::cat(values).narrow(0, 0, n).view_as(t));
  CommStats s = scatter;
  s += gather;
  s.collectives = 1;
  s.comm_seconds = s.wait_seconds = since(start);
  return s;
}

// Collectives among a group formed for one purpose (an evaluation across the live replicas).
class GlooCollectives final : public Transport {
 public:
  GlooCollectives(GlooGroup pg, int rank, int world, std::chrono::milliseconds timeout, CollectiveSeal sealing)
      : pg_(std::move(pg)), rank_(rank), world_(world), timeout_(timeout), sealing_(std::move(sealing)) {}
  int rank() const override { return rank_; }
  int world() const override { return world_; }
  void all_reduce_mean(torch::Tensor& t) override {
    charge(all_reduce_mean_over(*pg_, t, world_, timeout_, sealing_));
  }
  std::vector<torch::Tensor> all_gather(const torch::Tensor& bytes) override {
    CommStats cost;
    auto out = all_gather_over(*pg_, bytes, world_, timeout_, cost, sealing_);
    charge(cost);
    return out;
  }
  std::vector<torch::Tensor> all_to_all(const torch::Tensor& bytes) override {
    CommStats cost;
    auto out = all_to_all_over(*pg_, bytes, world_, timeout_, cost, sealing_);
    charge(cost);
    return out;
  }
  void broadcast(torch::Tensor& t, int root) override {
    charge(broadcast_over(*pg_, t, root, world_, timeout_, sealing_));
  }
  ExchangeResult exchange(const ExchangeRequest&) override {
    throw std::logic_error("a collectives-only group does no point-to-point exchanges");
  }
  void send_state(const std::string&, int, const MessageHeader&, const torch::Tensor&) override {
    throw std::logic_error("a collectives-only group hands over no state");
  }
  torch::Tensor receive_state(const std::string&, int, const MessageHeader&, int64_t) override {
    throw std::logic_error("a collectives-only group hands over no state");
  }
  std::unique_ptr<Transport> subgroup(const std::string&, const std::vector<Peer>&) override {
    throw std::logic_error("a collectives-only group has no subgroups");
  }

 private:
  GlooGroup pg_;
  int rank_, world_;
  std::chrono::milliseconds timeout_;
  CollectiveSeal sealing_;
};

}  // namespace

GlooTransport::GlooTransport(std::function<StorePtr()> connect, const WorkerEnv& env, std::string scope, Peer self,
                             int world, const std::string& bind, std::chrono::milliseconds timeout,
                             std::shared_ptr<const Seal> seal, Liveness* liveness)
    : connect_(std::move(connect)),
      env_(env),
      scope_(std::move(scope)),
      self_(self),
      world_(world),
      timeout_(timeout),
      run_id_(run_id_of(env.token)),
      seal_(std::move(seal)),
      liveness_(liveness),
      run_sealing_{seal_.get(), scope_, run_id_},
      store_(connect_()),
      device_(gloo_device(bind)),
      p2p_groups_([this](GlooGroup g) { release(std::move(g)); }) {}

P2pGroupCache::P2pGroupCache(std::function<void(GlooGroup)> release) : release_(std::move(release)) {}

P2pGroupCache::~P2pGroupCache() = default;

void P2pGroupCache::clear() { groups_.clear(); }

int64_t P2pGroupCache::generation(const std::string& members) const {
  const auto it = find(members);
  return it == groups_.end() ? 0 : it->generation;
}

GlooGroup P2pGroupCache::reuse(const std::string& members) {
  const auto it = find(members);
  groups_.splice(groups_.begin(), groups_, it);
  return it->group;
}

void P2pGroupCache::keep(const std::string& members, int64_t generation, GlooGroup group) {
  forget(members);
  groups_.push_front({members, generation, std::move(group)});
  constexpr size_t kMaxGroups = 64;
  if (groups_.size() > kMaxGroups) {
    release_(std::move(groups_.back().group));
    groups_.pop_back();
  }
}

void P2pGroupCache::forget(const std::string& members) {
  const auto it = find(members);
  if (it == groups_.end()) return;
  release_(std::move(it->group));
  groups_.erase(it);
}

std::list<P2pGroupCache::Entry>::const_iterator P2pGroupCache::find(const std::string& members) const {
  return std::find_if(groups_.begin(), groups_.end(), [&](const Entry& e) { return e.members == members; });
}

std::list<P2pGroupCache::Entry>::iterator P2pGroupCache::find(const std::string& members) {
  return std::find_if(groups_.begin(), groups_.end(), [&](const Entry& e) { return e.members == members; });
}

GlooTransport::~GlooTransport() {
  p2p_groups_.clear();
  if (releasing_.joinable()) releasing_.join();
}

namespace {

std::vector<int> ranks_of(const std::vector<Peer>& peers) {
  std::vector<int> ranks;
  for (const auto& p : peers) ranks.push_back(p.rank);
  return ranks;
}

}  // namespace

bool GlooTransport::given_up(int rank, Clock::time_point since) const {
  return liveness_ && liveness_->given_up(rank, since);
}

bool GlooTransport::any_gone(const std::vector<int>& ranks) const {
  if (!liveness_) return false;
  liveness_->progressed();
  const auto now = Clock::now();
  return std::any_of(ranks.begin(), ranks.end(), [&](int r) { return r != self_.rank && given_up(r, now); });
}

bool GlooTransport::silent(int rank) const {
  if (!liveness_) return false;
  liveness_->progressed();
  return liveness_->silent(rank);
}

GlooGroup GlooTransport::join(const std::string& name, int rank, int world, const std::function<bool()>& abandon,
                              PairRoutes* routes) {
  return join_gloo_group(store_, env_, name, rank, world, device_, timeout_, seal_.get(), abandon, routes);
}

double GlooTransport::note_routes(const PairRoutes& routes, const std::vector<Peer>& members) {
  const double share = routes.relayed_share();
  std::lock_guard<std::mutex> lock(routes_mutex_);
  for (size_t i = 0; i < members.size(); ++i)
    if (!(members[i] == self_)) relayed_to_[members[i].rank] = routes.relayed_with(int(i));
  if (routes.relayed > 0) relays_used_.insert(routes.relay);
  return share;
}

bool GlooTransport::relayed_to(int rank) const {
  std::lock_guard<std::mutex> lock(routes_mutex_);
  const auto it = relayed_to_.find(rank);
  return it != relayed_to_.end() && it->second;
}

CommStats GlooTransport::relayed(CommStats cost, double share) {
  cost.bytes_relayed += uint64_t(share * double(cost.bytes_sent));
  return cost;
}

std::vector<std::string> GlooTransport::relays_used() const {
  std::lock_guard<std::mutex> lock(routes_mutex_);
  return {relays_used_.begin(), relays_used_.end()};
}

void GlooTransport::release(GlooGroup group) {
  std::lock_guard<std::mutex> lock(release_mutex_);
  if (releasing_.joinable()) releasing_.join();  // the previous teardown: long done unless exchanges are back to back
  releasing_ = std::thread([g = std::move(group)]() mutable { g.reset(); });
}

c10d::ProcessGroupGloo& GlooTransport::run_group() {
  if (self_.incarnation > 0) throw std::runtime_error("a restarted worker is not part of the run-wide group");
  if (!run_group_) {
    PairRoutes routes;
    run_group_ = join(scope_, self_.rank, world_, nullptr, &routes);
    run_group_relayed_ = note_routes(routes, {});
  }
  return *run_group_;
}

void GlooTransport::all_reduce_mean(torch::Tensor& t) {
  auto& group = run_group();
  charge(relayed(all_reduce_mean_over(group, t, world_, timeout_, run_sealing_), run_group_relayed_));
}

void GlooTransport::broadcast(torch::Tensor& t, int root) {
  auto& group = run_group();
  charge(relayed(broadcast_over(group, t, root, world_, timeout_, run_sealing_), run_group_relayed_));
}

std::vector<torch::Tensor> GlooTransport::all_gather(const torch::Tensor& bytes) {
  CommStats cost;
  auto out = all_gather_over(run_group(), bytes, world_, timeout_, cost, run_sealing_);
  charge(relayed(cost, run_group_relayed_));
  return out;
}

std::vector<torch::Tensor> GlooTransport::all_to_all(const torch::Tensor& bytes) {
  CommStats cost;
  auto out = all_to_all_over(run_group(), bytes, world_, timeout_, cost, run_sealing_);
  charge(relayed(cost, run_group_relayed_));
  return out;
}

std::unique_ptr<Transport> GlooTransport::subgroup(const std::string& name, const std::vector<Peer>& members) {
  const auto me = std::find(members.begin(), members.end(), self_);
  if (me == members.end()) throw std::logic_error("subgroup without this member");
  const int index = int(me - members.begin()), size = int(members.size());
  const auto ranks = ranks_of(members);
  // Its own store connection: an exchange may be meeting on store_ on another thread (overlap=true).
  auto group = join_gloo_group(connect_(), env_, scope_ + "/" + name + "/" + members_key(members), index, size, device_,
                               timeout_, seal_.get(), [&] { return any_gone(ranks); });
  const auto group_name = scope_ + "/" + name;
  return std::make_unique<GlooCollectives>(std::move(group), index, size, timeout_,
                                           CollectiveSeal{seal_.get(), group_name, run_id_});
}

std::vector<Peer> GlooTransport::meet(const std::string& key, const std::vector<Peer>& peers, std::vector<int>* late,
                                      int64_t my_generation, std::map<int, int64_t>* generations,
                                      std::vector<int>* declined) {
  // Each member adds 1 to its own counter under the exchange's key and blocks
  // until every peer's counter exists: event-driven, so members meet as soon
  // as all are there. A watchdog on its own store connection adds 2 for a
  // peer that is given up or has not come within the timeout, which wakes the
  // wait. A counter of exactly 1 means "came, and not given up"; a member
  // that finds more on arriving was given up and goes on alone; one that
  // will not come adds kStaysAway to its own (it is alive: not late).
  // (Counters, not compareSet: the store wakes waiters on add, not on compareSet.)
  // With a liveness authority the wait is patient, without a deadline: the
  // authority decides, and is told about once a second that this member is
  // waiting, not stuck (for the members waiting for it).
  const bool patient = liveness_ != nullptr;
  const auto meetings = meeting_room(store_);
  auto here = [&](int r) { return arrival_key(key, r); };
  auto generation_key = [&](int r) { return fmt::format("{}/generation/{}", key, r); };
  const auto generation = std::to_string(my_generation);
  meetings->set(generation_key(self_.rank), std::vector<uint8_t>(generation.begin(), generation.end()));
  if (meetings->add(here(self_.rank), 1) != 1) return {};
  std::vector<std::string> keys;
  for (const auto& peer : peers) keys.push_back(here(peer.rank));
  if (!meetings->check(keys)) {
    if (!watch_) watch_ = connect_();
    const auto watch = meeting_room(watch_);
    const auto start = Clock::now(), deadline = start + timeout_;
    auto noted = start;
    Ticker watchdog(std::chrono::milliseconds(20), [&] {
      for (const auto& peer : peers) {
        if (((!patient && Clock::now() > deadline) || given_up(peer.rank, start)) && !watch->check({here(peer.rank)}))
          watch->add(here(peer.rank), 2);
      }
      if (patient && Clock::now() - noted > std::chrono::seconds(1)) {
        liveness_->progressed();
        noted = Clock::now();
      }
      return false;
    });
    for (;;) {
      try {
        meetings->wait(keys, timeout_ + std::chrono::seconds(30));
        break;
      } catch (const std::exception&) {
        if (!patient) throw;
        if (meetings->check(keys)) break;  // else the peers are behind and moving: wait on
      }
    }
  }
  std::vector<Peer> present;
  for (const auto& peer : peers) {
    const auto counter = meetings->add(here(peer.rank), 0);
    if (counter >= kStaysAway && declined) {
      declined->push_back(peer.rank);
      continue;
    }
    if (counter != 1) {
      late->push_back(peer.rank);
      continue;
    }
    present.push_back(peer);
    const auto value = meetings->get(generation_key(peer.rank));
    (*generations)[peer.rank] = std::stoll(std::string(value.begin(), value.end()));
  }
  return present;
}

StorePtr GlooTransport::meeting_room(const StorePtr& store) const {
  return run_scope(store, env_.token, scope_ + "/meet");
}

void GlooTransport::stay_away(const std::string& key) { meeting_room(store_)->add(arrival_key(key, self_.rank), kStaysAway); }

ExchangeResult GlooTransport::exchange(const ExchangeRequest& request) {
  const auto start = Clock::now();
  CommStats cost;
  ExchangeResult result;
  std::vector<Peer> peers;
  for (const auto& p : request.group)
    if (p.rank != self_.rank) peers.push_back(p);
  if (peers.empty()) return result;
  TORCH_CHECK(request.payload.scalar_type() == torch::kUInt8 && request.payload.is_contiguous() &&
                  request.header.bytes == request.payload.numel(),
              "exchange payloads are contiguous bytes described by their header");
  const std::string planned = members_key(request.group);
  if (relays_in_use() && relays_lost() != relays_lost_seen_) {
    p2p_groups_.clear();  // some may run through the relay that went
    relays_lost_seen_ = relays_lost();
  }
  std::map<int, int64_t> generations;
  const auto present =
      meet(fmt::format("{}/{}", request.id, planned), peers, &result.lost, p2p_groups_.generation(planned), &generations);
  bool whole = present.size() == peers.size();
  const auto late = result.lost;
  auto waiting_since = start;
  bool reused = false;
  auto group =
      present.empty() ? GlooGroup() : acquire_group(request.id, planned, whole, present, generations, "", &reused);
  const auto traded_from = Clock::now();
  bool failed = group && trade(*group, request, present, start, &result, &cost);
  auto members = present;
  if (relays_in_use() && !present.empty()) {
    // Through a relay, a connection that closed says nothing of the peer: its
    // relay may be gone. The members that saw theirs close form the group anew
    // (through another relay) and trade again. They agree at a second meeting,
    // where a member that got through, or spent half its timeout trading,
    // says it stays away: a member deciding alone waited its whole timeout
    // for one that never came and declared it dead. A peer that did die is
    // given up at that meeting, once its heartbeat is silent.
    const auto again = fmt::format("{}/{}/again", request.id, planned);
    if (!failed || since(traded_from) >= 0.5 * std::chrono::duration<double>(timeout_).count()) {
      stay_away(again);
    } else {
      spdlog::warn("exchange {}: a connection {} closed, or its relay went; forming the group anew", request.id,
                   reused ? "kept since an earlier exchange" : "of its group");
      group.reset();
      p2p_groups_.forget(planned);
      result = ExchangeResult();
      result.lost = late;
      waiting_since = Clock::now();  // the first try's wait is counted already
      std::map<int, int64_t> unused;
      std::vector<int> declined;
      members = meet(again, present, &result.lost, 0, &unused, &declined);
      whole = whole && members.size() == present.size();
      group = members.empty() ? GlooGroup()
                              : acquire_group(request.id, planned, whole, members, generations, "again", &reused);
      failed = group && trade(*group, request, members, waiting_since, &result, &cost);
    }
  }
  if (!group) {
    // Unless this member gave the group up itself (it leaves the run): its partners are not to blame.
    if (!leave_requested())
      for (const auto& p : members) result.lost.push_back(p.rank);
    cost.wait_seconds += since(waiting_since);
  } else {
    // A failed group is never used again (a timed-out Gloo pair stays
    // closed), nor one that carried a refused message (its payload stays
    // posted on the pair); one formed for part of the group is not kept either.
    if (!whole) {
      release(std::move(group));
    } else if (failed || result.lost.size() > late.size()) {
      group.reset();
      p2p_groups_.forget(planned);
    }
  }
  std::sort(result.lost.begin(), result.lost.end());
  if (liveness_)
    for (int r : result.lost) liveness_->declare_dead(r);  // later snapshots leave it out
  cost.comm_seconds += since(start);
  charge(cost);
  return result;
}

GlooGroup GlooTransport::acquire_group(int64_t exchange, const std::string& planned, bool whole,
                                       const std::vector<Peer>& present, const std::map<int, int64_t>& generations,
                                       const std::string& attempt, bool* reused) {
  // Reuse the group of the last exchange among exactly these members, if
  // every one of them still holds the same one (the generation they announce).
  const int64_t mine = p2p_groups_.generation(planned);
  const bool reuse = whole && mine != 0 && std::all_of(present.begin(), present.end(), [&](const Peer& p) {
                       return generations.at(p.rank) == mine;
                     });
  *reused = reuse;
  if (reuse) return p2p_groups_.reuse(planned);
  auto members = with_self(present);
  const int index = int(std::find(members.begin(), members.end(), self_) - members.begin());
  try {
    // Named by this exchange, so that no member can ever meet a stale group.
    const int64_t generation = exchange + 1;
    // A member that came to the meeting and died since (declared dead, or
    // its heartbeat silent) would hold the others for the whole timeout.
    // So would this member's own SIGTERM (asked to leave at the end of its
    // step): a partner it cannot reach would hold it for peer_timeout.
    const auto ranks = ranks_of(present);
    PairRoutes routes;
    auto group = join(fmt::format("{}/p2p/{}/{}{}", scope_, members_key(members), generation, attempt), index,
                      int(members.size()), [&] { return leave_requested() || any_gone(ranks); }, &routes);
    note_routes(routes, members);
    if (whole) p2p_groups_.keep(planned, generation, group);
    return group;
  } catch (const std::exception& e) {
    if (leave_requested()) {
      spdlog::info("exchange {} given up while its group formed: this worker leaves the run (SIGTERM)", exchange);
      return GlooGroup();
    }
    // A member died after announcing itself: go on without any of them.
    spdlog::warn("exchange {} could not form its group; going on alone: {}", exchange, error_text(e));
    return GlooGroup();
  }
}

bool GlooTransport::trade(c10d::ProcessGroupGloo& group, const ExchangeRequest& request,
                          const std::vector<Peer>& present, Clock::time_point start, ExchangeResult* result,
                          CommStats* cost) {
  const auto members = with_self(present);
  auto member_of = [&](const Peer& p) { return int(std::find(members.begin(), members.end(), p) - members.begin()); };
  const int tag = int(request.id % (int64_t(1) << 29)) * framed_tags(1);
  auto expected = request.header;
  expected.run = run_id_;
  // Every header's receive is posted before any send. The payload's is posted
  // once its header is checked: a peer's announced length is input, and Gloo
  // aborts the process on a payload longer than the buffer waiting for it.
  std::vector<FramedReceive> incoming;
  std::vector<std::optional<FramedSend>> sends(present.size());
  std::vector<bool> refused(present.size(), false);
  bool failed = false;
  try {
    for (const auto& p : present)
      incoming.emplace_back(group, member_of(p), tag, expected, std::vector<torch::Tensor>{torch::empty_like(request.payload)},
                            /*eager=*/false, seal_.get());
  } catch (const std::exception& e) {
    spdlog::warn("exchange {} failed to start: {}", request.id, error_text(e));
    failed = true;
  }
  // Each message on its own: a pair a dead member closed must not hold back
  // the others' (they waited out peer_timeout for messages never sent).
  const bool corrupt = corrupt_next_send_.exchange(false);
  for (size_t i = 0; i < present.size() && incoming.size() == present.size(); ++i) {
    try {
      sends[i].emplace(group, member_of(present[i]), tag, expected, std::vector<torch::Tensor>{request.payload},
                       seal_.get(), corrupt);
    } catch (const std::exception& e) {
      spdlog::warn("exchange {}: no message could go to worker {}: {}", request.id, present[i].rank, error_text(e));
      failed = true;
      incoming[i].abort();  // its pair is closed: nothing comes over it either
    }
  }
  // A relay lost now may leave a pair waiting out its whole timeout (see
  // relays_lost): the trade is given up at once, and formed anew.
  const auto lost_before = relays_lost();
  std::optional<Ticker> relay_watch;
  if (relays_in_use())
    relay_watch.emplace(std::chrono::milliseconds(50), [&] {
      if (relays_lost() == lost_before) return false;
      for (auto& r : incoming) r.abort();
      for (auto& s : sends)
        if (s) s->abort();
      return true;
    });
  for (size_t i = 0; i < incoming.size(); ++i) {
    const int rank = present[i].rank;
    switch (incoming[i].wait(timeout_)) {
      case Delivery::received:
        result->received[rank] = incoming[i].parts()[0];
        cost->bytes_received += incoming[i].wire_bytes();
        break;
      case Delivery::unauthentic:
        spdlog::error("worker {}'s message failed authentication: not used; the worker is handled as lost: {}", rank,
                      incoming[i].problem());
        result->lost.push_back(rank);
        failed = true;
        break;
      case Delivery::rejected:
        spdlog::error("rejected a message from worker {}: {}", rank, incoming[i].problem());
        result->lost.push_back(rank);
        // The header checks are symmetric: the peer rejects ours too and
        // never takes our payload.
        refused[i] = true;
        if (sends[i]) sends[i]->abort();
        break;
      default:  // died or timed out during the exchange: its pair is closed
        spdlog::warn("exchange {}: worker {}'s message did not come: {}", request.id, rank, incoming[i].problem());
        result->lost.push_back(rank);
        failed = true;
    }
  }
  cost->wait_seconds += since(start);
  for (size_t i = 0; i < sends.size(); ++i) {
    auto& send = sends[i];
    if (refused[i] || !send) continue;
    try {
      send->wait(timeout_);
      cost->bytes_sent += send->wire_bytes();
      if (relayed_to(present[i].rank)) cost->bytes_relayed += send->wire_bytes();
      cost->messages += 1;
    } catch (const std::exception&) {
      failed = true;
    }
  }
  return failed;
}

std::vector<Peer> GlooTransport::with_self(std::vector<Peer> peers) const {
  peers.push_back(self_);
  std::sort(peers.begin(), peers.end(), [](const Peer& a, const Peer& b) { return a.rank < b.rank; });
  return peers;
}

void GlooTransport::send_state(const std::string& channel, int receiver, const MessageHeader& header,
                               const torch::Tensor& bytes) {
  const auto start = Clock::now();
  PairRoutes routes;
  auto pg = join_gloo_group(connect_(), env_, scope_ + "/handover/" + channel, 0, 2, device_, timeout_, seal_.get(),
                            [&] { return silent(receiver); }, &routes);
  auto stamped = header;
  stamped.run = run_id_;
  FramedSend send(*pg, 1, 0, stamped, {bytes.contiguous()}, seal_.get());
  send.wait(timeout_);
  CommStats cost;
  cost.bytes_sent = send.wire_bytes();
  cost.messages = 1;
  cost.comm_seconds = since(start);
  charge(relayed(cost, note_routes(routes, {})));
  release(std::move(pg));
}

torch::Tensor GlooTransport::receive_state(const std::string& channel, int donor, const MessageHeader& expected,
                                           int64_t max_bytes) {
  const auto start = Clock::now();
  auto pg = join_gloo_group(connect_(), env_, scope_ + "/handover/" + channel, 1, 2, device_, timeout_, seal_.get(),
                            [&] { return silent(donor); });
  auto stamped = expected;
  stamped.run = run_id_;
  FramedReceive receive(*pg, 0, 0, stamped, max_bytes, seal_.get());
  switch (receive.wait(timeout_)) {
    case Delivery::received: break;
    case Delivery::unauthentic:
      throw std::runtime_error("the state offered to this worker failed authentication: " + receive.problem());
    case Delivery::rejected: throw std::runtime_error("rejected the state offered to this worker: " + receive.problem());
    default: throw std::runtime_error("the state's donor was lost during the hand-over: " + receive.problem());
  }
  auto bytes = receive.parts()[0];
  CommStats cost;
  cost.bytes_received = receive.wire_bytes();
  cost.comm_seconds = since(start);
  charge(cost);
  release(std::move(pg));
  return bytes;
}

}  // namespace noloco
