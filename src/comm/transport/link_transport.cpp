#include "comm/transport/link_transport.h"

#include <algorithm>
#include <mutex>
#include <thread>
#include <utility>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <spdlog/spdlog.h>

#include "comm/store/run_keys.h"
#include "comm/store/store_outage.h"
#include "comm/transport/link_messages.h"
#include "comm/transport/ticker.h"
#include "util/leave_signal.h"

namespace noloco {

namespace {

double since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

std::string members_key(const std::vector<Peer>& members) {
  std::string key;
  for (const auto& p : members) key += fmt::format("{}.{}_", p.rank, p.incarnation);
  return key;
}

std::vector<int> ranks_of(const std::vector<Peer>& peers) {
  std::vector<int> ranks;
  for (const auto& p : peers) ranks.push_back(p.rank);
  return ranks;
}

// Up to eight ranks of a list, and how many more: a group of tens would fill lines with them.
std::string few_of(const std::vector<int>& ranks) {
  if (ranks.empty()) return "none";
  constexpr size_t kNamed = 8;
  const std::vector<int> named(ranks.begin(), ranks.begin() + long(std::min(ranks.size(), kNamed)));
  return ranks.size() > kNamed ? fmt::format("{} and {} more", fmt::join(named, ", "), ranks.size() - kNamed)
                               : fmt::format("{}", fmt::join(named, ", "));
}

uint8_t* bytes_ptr(const torch::Tensor& t) { return static_cast<uint8_t*>(t.data_ptr()); }

}  // namespace

LinkTransport::LinkTransport(std::function<StorePtr()> connect, const WorkerEnv& env, std::string scope, Peer self,
                             int world, std::shared_ptr<LinkEndpoint> endpoint, std::chrono::milliseconds timeout,
                             Liveness* liveness)
    : connect_(std::move(connect)),
      env_(env),
      scope_(std::move(scope)),
      self_(self),
      world_(world),
      endpoint_(std::move(endpoint)),
      timeout_(timeout),
      run_id_(run_id_of(env.token)),
      liveness_(liveness),
      meeting_(connect_, env.token, scope_, self.rank, timeout, liveness),
      exchanges_(connect_(), env.token, {scope_, self.rank, self.incarnation}, endpoint_),
      handovers_(connect_(), env.token, {record::handover_book(scope_), self.rank, self.incarnation}, endpoint_),
      meshes_(connect_(), env.token, {record::mesh_book(scope_), self.rank, self.incarnation}, endpoint_),
      groups_(connect_(), env.token, {record::subgroup_book(scope_), self.rank, self.incarnation}, endpoint_) {}

LinkTransport::~LinkTransport() = default;

bool LinkTransport::given_up(int rank, Clock::time_point since) const {
  return liveness_ && liveness_->given_up(rank, since);
}

bool LinkTransport::any_gone(const std::vector<int>& ranks, std::optional<int64_t> exchange) const {
  if (!liveness_) return false;
  liveness_->progressed();
  const auto now = Clock::now();
  // A member that went alone at the exchange being traded (or, forming a
  // group between exchanges, at the last one reached or later) will not come.
  const auto alone = [&](int r) {
    return exchange ? liveness_->went_alone(r, *exchange, false)
                    : liveness_->went_alone(r, liveness_->exchange_reached(), true);
  };
  return std::any_of(ranks.begin(), ranks.end(),
                     [&](int r) { return r != self_.rank && (given_up(r, now) || alone(r)); });
}

bool LinkTransport::silent(int rank) const {
  if (!liveness_) return false;
  liveness_->progressed();
  return liveness_->silent(rank);
}

std::vector<std::string> LinkTransport::relays_used() const {
  std::set<std::string> used;
  for (const auto* book : {&exchanges_, &handovers_, &meshes_, &groups_}) {
    const auto relays = book->relays_used();
    used.insert(relays.begin(), relays.end());
  }
  return {used.begin(), used.end()};
}

std::map<int, LinkRoute> LinkTransport::routes() const {
  auto routes = meshes_.routes();  // DiLoCo's
  for (const auto& [peer, route] : exchanges_.routes()) routes[peer] = route;  // NoLoCo's
  return routes;
}

std::vector<LinkPtr> LinkTransport::open_links(LinkBook& book, const std::vector<Peer>& peers,
                                               const std::map<int, int64_t>& theirs, const std::string& attempt,
                                               const std::function<bool(int)>& abandon,
                                               std::vector<std::string>* problems) {
  std::vector<LinkPtr> links(peers.size());
  problems->assign(peers.size(), "");
  const auto deadline = Clock::now() + timeout_;
  std::vector<std::exception_ptr> failed(peers.size());  // thrown here, not in a thread: that would end the process
  std::vector<std::thread> opening;
  for (size_t i = 0; i < peers.size(); ++i)
    opening.emplace_back([&, i] {
      try {
        const auto it = theirs.find(peers[i].rank);
        links[i] = book.link_to(end_of(book, peers[i]), it == theirs.end() ? 0 : it->second, attempt, deadline,
                                [&, i] { return abandon(peers[i].rank); }, &(*problems)[i]);
      } catch (...) {
        failed[i] = std::current_exception();
      }
    });
  for (auto& t : opening) t.join();
  for (const auto& e : failed)
    if (e) std::rethrow_exception(e);
  return links;
}

std::unique_ptr<LinkCollectives> LinkTransport::form_mesh(LinkBook& book, const std::vector<Peer>& members,
                                                          const std::string& attempt) {
  const auto me = std::find(members.begin(), members.end(), self_);
  if (me == members.end()) throw std::logic_error("a group without this member");
  std::vector<Peer> peers;
  for (const auto& p : members)
    if (!(p == self_)) peers.push_back(p);
  const auto ranks = ranks_of(peers);
  // A member that gives the group up (another is gone) says so in the store:
  // those whose links to it opened would otherwise wait out their timeout
  // for the links it never opens.
  const auto marks = run_scope(connect_(), env_.token, record::formations(scope_));
  const auto abandoned = record::formation_abandoned(attempt, members_key(members));
  std::mutex marks_mutex;  // one store connection, asked from every opening thread
  const auto given_up_by_any = [&](int) {
    if (any_gone(ranks)) return true;
    std::lock_guard<std::mutex> lock(marks_mutex);
    return marks->check({abandoned});
  };
  std::vector<std::string> problems;
  const auto opened = open_links(book, peers, {}, attempt, given_up_by_any, &problems);
  std::vector<LinkPtr> links(members.size());
  std::vector<int> alive, silent_ones;  // the members whose links did not open, by their heartbeats
  std::string first_problem;
  for (size_t i = 0, j = 0; i < members.size(); ++i) {
    if (members[i] == self_) continue;
    if (!opened[j]) {
      (silent(members[i].rank) ? silent_ones : alive).push_back(members[i].rank);
      if (first_problem.empty()) first_problem = fmt::format("member {}: {}", members[i].rank, problems[j]);
    }
    links[i] = opened[j++];
  }
  if (!alive.empty() || !silent_ones.empty()) {
    marks->set(abandoned, std::vector<uint8_t>{1});
    throw std::runtime_error(fmt::format("{}: the links to {} of {} members did not open; alive by their heartbeats: "
                                         "{}; silent: {}; {}",
                                         attempt, alive.size() + silent_ones.size(), peers.size(), few_of(alive),
                                         few_of(silent_ones), first_problem));
  }
  return std::make_unique<LinkCollectives>(std::move(links), int(me - members.begin()), run_id_, timeout_);
}

LinkCollectives& LinkTransport::run_mesh() {
  if (run_mesh_ && run_mesh_->intact()) return *run_mesh_;
  run_mesh_.reset();
  const auto deadline = Clock::now() + timeout_;
  std::vector<Peer> members;
  for (int r = 0; r < world_; ++r) {
    if (r == self_.rank) {
      members.push_back(self_);
      continue;
    }
    const int incarnation = meshes_.incarnation_of(r, deadline, [&] { return any_gone({r}); });
    if (incarnation < 0)
      throw std::runtime_error(fmt::format("member {} of {} did not start within the peer timeout", r, scope_));
    members.push_back({r, incarnation});
  }
  run_mesh_ = form_mesh(meshes_, members, record::run_mesh(meshes_formed_++));
  return *run_mesh_;
}

// A collective's cost is the run mesh's, charged here as well.
template <class Op>
auto LinkTransport::on_run_mesh(Op op) {
  auto& mesh = run_mesh();
  const auto before = mesh.stats();
  struct Charge {
    LinkTransport* self;
    LinkCollectives& mesh;
    CommStats before;
    ~Charge() {
      auto cost = mesh.stats();
      cost -= before;
      self->charge(cost);
    }
  } charged{this, mesh, before};
  return op(mesh);
}

void LinkTransport::all_reduce_mean(torch::Tensor& t) {
  on_run_mesh([&](LinkCollectives& m) { m.all_reduce_mean(t); });
}

std::vector<torch::Tensor> LinkTransport::all_gather(const torch::Tensor& bytes) {
  return on_run_mesh([&](LinkCollectives& m) { return m.all_gather(bytes); });
}

std::vector<torch::Tensor> LinkTransport::all_to_all(const torch::Tensor& bytes) {
  return on_run_mesh([&](LinkCollectives& m) { return m.all_to_all(bytes); });
}

void LinkTransport::broadcast(torch::Tensor& t, int root) {
  on_run_mesh([&](LinkCollectives& m) { m.broadcast(t, root); });
}

std::unique_ptr<Collectives> LinkTransport::subgroup(const std::string& name, const std::vector<Peer>& members) {
  return form_mesh(groups_, members, name);
}

ExchangeResult LinkTransport::exchange(const ExchangeRequest& request) {
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
  const auto key = record::exchange(request.id, members_key(request.group));
  std::map<int, int64_t> mine;
  for (const auto& p : peers) mine[p.rank] = exchanges_.held(end_of(exchanges_, p));
  const auto met = meeting_.meet(key, request.id, peers, mine, request.note, request.partner_wait);
  result.lost = met.late;
  result.behind = met.behind;
  result.left_behind = met.left_behind;
  result.notes = met.notes;
  const auto traded_from = Clock::now();
  auto failures = trade(request, met.present, met.theirs, std::to_string(request.id), start, &result, &cost);
  std::vector<Peer> retry;
  for (const auto& f : failures) {
    if (f.retry)
      retry.push_back(f.peer);
    else
      result.lost.push_back(f.peer.rank);
  }
  if (endpoint_->has_relays() && !met.present.empty()) {
    // Through a relay, a link that broke says nothing of the peer: its relay
    // may be gone. The pairs whose links broke open new ones (through another
    // relay) and trade again. They agree at a second meeting, where a member
    // that got through, or spent half its timeout trading, says it stays
    // away: a member deciding alone waited its whole timeout for one that
    // never came and declared it dead. A peer that did die is given up at
    // that meeting, once its heartbeat is silent.
    const auto again = record::retry_of(key);
    if (retry.empty() || since(traded_from) >= 0.5 * std::chrono::duration<double>(timeout_).count()) {
      meeting_.stay_away(again);
      for (const auto& p : retry) result.lost.push_back(p.rank);
    } else {
      spdlog::warn("exchange {}: a relayed link broke (its relay may be gone); opening it anew", request.id);
      const auto waiting_since = Clock::now();
      const auto second = meeting_.meet(again, request.id, retry, {});
      result.lost.insert(result.lost.end(), second.late.begin(), second.late.end());
      result.behind.insert(result.behind.end(), second.behind.begin(), second.behind.end());
      for (const auto& f :
           trade(request, second.present, second.theirs, fmt::format("{}/again", request.id), waiting_since, &result, &cost))
        result.lost.push_back(f.peer.rank);
    }
  } else {
    for (const auto& p : retry) result.lost.push_back(p.rank);
  }
  std::sort(result.lost.begin(), result.lost.end());
  try {
    if (liveness_)
      for (int r : result.lost) liveness_->declare_dead(r);  // later snapshots leave it out
  } catch (const StoreUnreachable&) {  // what arrived is used; a partner lost meanwhile is given up by its silence
  }
  cost.comm_seconds += since(start);
  charge(cost);
  return result;
}

std::vector<LinkTransport::Failure> LinkTransport::trade(const ExchangeRequest& request,
                                                         const std::vector<Peer>& present,
                                                         const std::map<int, int64_t>& theirs,
                                                         const std::string& attempt, Clock::time_point start,
                                                         ExchangeResult* result, CommStats* cost) {
  std::vector<Failure> failed;
  if (present.empty()) return failed;
  // Unless this member leaves the run (SIGTERM) or a partner is gone: a
  // partner it cannot reach would hold it for the whole timeout.
  std::vector<std::string> problems;
  const auto links =
      open_links(exchanges_, present, theirs, attempt,
                 [&](int rank) { return leave_requested() || any_gone({rank}, request.id); }, &problems);
  auto stamped = request.header;
  stamped.run = run_id_;
  const bool corrupt = corrupt_next_send_.exchange(false);
  std::vector<LinkTrade> trades;
  std::vector<size_t> traded;  // index into present
  std::vector<torch::Tensor> incoming(present.size());
  for (size_t i = 0; i < present.size(); ++i) {
    if (!links[i]) {
      if (leave_requested()) {
        spdlog::info("exchange {} given up while its links opened: this worker leaves the run (SIGTERM)", request.id);
      } else {
        spdlog::warn("exchange {}: no link to worker {} came: {}", request.id, present[i].rank, problems[i]);
        failed.push_back({present[i], false});
      }
      continue;
    }
    if (corrupt) links[i]->corrupt_next_send();
    incoming[i] = torch::empty_like(request.payload);
    LinkTrade t;
    t.link = links[i].get();
    t.header = t.expected = stamped;
    t.payload = {{bytes_ptr(request.payload), size_t(request.payload.numel())}};
    t.place = [target = incoming[i]](const MessageHeader&) {
      return std::vector<Link::Slot>{{bytes_ptr(target), size_t(target.numel())}};
    };
    trades.push_back(std::move(t));
    traded.push_back(i);
  }
  // A peer that went alone at this exchange (it lost the store after it came
  // to the meeting) sends nothing of it: not lost, not waited for. One that
  // is merely at a later exchange has written its message of this one, which
  // may not have been read here yet.
  if (const auto hook = std::exchange(before_next_trade_, nullptr)) hook();
  std::vector<uint64_t> received_before(trades.size());
  std::vector<char> went_on(trades.size(), 0);
  for (size_t k = 0; k < trades.size(); ++k) received_before[k] = trades[k].link->bytes_received();
  {
    // A peer the liveness authority gives up meanwhile is not waited for.
    Ticker watch(std::chrono::milliseconds(50), [&] {
      for (size_t k = 0; k < trades.size(); ++k) {
        const int rank = present[traded[k]].rank;
        if (given_up(rank, start)) {
          trades[k].link->shut();
        } else if (trades[k].link->bytes_received() == received_before[k] && liveness_ &&
                   liveness_->went_alone(rank, request.id, false)) {
          went_on[k] = 1;
          trades[k].link->shut();
        }
      }
      return false;
    });
    trade_messages(trades, Clock::now() + timeout_);
  }
  for (size_t k = 0; k < trades.size(); ++k) {
    const auto& t = trades[k];
    const auto& peer = present[traded[k]];
    const auto& link = links[traded[k]];
    cost->sent_over(link->route(), t.bytes_sent);
    cost->bytes_received += t.bytes_received;
    if (t.sent) cost->messages += 1;
    switch (t.incoming.delivery) {
      case Delivery::received:
        result->received[peer.rank] = incoming[traded[k]];
        if (!t.sent) exchanges_.forget(end_of(exchanges_, peer));
        continue;
      case Delivery::unauthentic:
        spdlog::error("worker {}'s message failed authentication: not used; the worker is handled as lost: {}",
                      peer.rank, t.incoming.problem);
        failed.push_back({peer, false});
        break;
      case Delivery::rejected:
        spdlog::error("rejected a message from worker {}: {}", peer.rank, t.incoming.problem);
        failed.push_back({peer, false});
        break;
      default:
        if (leave_requested()) break;
        if (went_on[k]) {
          spdlog::info("exchange {}: worker {} went on without it (alone there, its store away)", request.id, peer.rank);
          break;
        }
        spdlog::warn("exchange {}: worker {}'s message did not come: {}", request.id, peer.rank, t.incoming.problem);
        failed.push_back({peer, link->route() == LinkRoute::relayed});
    }
    exchanges_.forget(end_of(exchanges_, peer));
  }
  cost->wait_seconds += since(start);
  return failed;
}

LinkPtr LinkTransport::handover_link(const std::string& channel, int peer, const char* role) {
  const auto deadline = Clock::now() + timeout_;
  const int incarnation = handovers_.incarnation_of(peer, deadline, [&] { return silent(peer); });
  if (incarnation < 0) throw std::runtime_error(fmt::format("the state's {} (worker {}) never published its links", role, peer));
  std::string problem;
  // A link for this hand-over alone, closed after it.
  auto link = handovers_.link_to({handovers_.self().scope, peer, incarnation}, 0, channel, deadline,
                                 [&] { return silent(peer); }, &problem);
  if (!link) throw std::runtime_error(fmt::format("no link to the state's {} (worker {}): {}", role, peer, problem));
  return link;
}

void LinkTransport::send_state(const std::string& channel, int receiver, const MessageHeader& header,
                               const torch::Tensor& bytes) {
  const auto start = Clock::now();
  const auto link = handover_link(channel, receiver, "receiver");
  auto stamped = header;
  stamped.run = run_id_;
  const auto payload = bytes.contiguous();
  const auto before = link->bytes_sent();
  if (!send_message(*link, stamped, {{bytes_ptr(payload), size_t(payload.nbytes())}}, Clock::now() + timeout_)) {
    handovers_.forget(link->peer());
    throw std::runtime_error("the state did not reach its receiver: " + link->problem());
  }
  CommStats cost;
  cost.sent_over(link->route(), link->bytes_sent() - before);
  cost.messages = 1;
  cost.comm_seconds = since(start);
  charge(cost);
  handovers_.forget(link->peer());
}

torch::Tensor LinkTransport::receive_state(const std::string& channel, int donor, const MessageHeader& expected,
                                           int64_t max_bytes) {
  const auto start = Clock::now();
  const auto link = handover_link(channel, donor, "donor");
  auto stamped = expected;
  stamped.run = run_id_;
  torch::Tensor bytes;
  const auto before = link->bytes_received();
  const auto in = receive_message(
      *link, stamped,
      [&](const MessageHeader& h) {
        bytes = torch::empty({h.bytes}, torch::kUInt8);
        return std::vector<Link::Slot>{{bytes_ptr(bytes), size_t(h.bytes)}};
      },
      Clock::now() + timeout_, false, max_bytes);
  if (in.delivery != Delivery::received) handovers_.forget(link->peer());
  switch (in.delivery) {
    case Delivery::received: break;
    case Delivery::unauthentic:
      throw std::runtime_error("the state offered to this worker failed authentication: " + in.problem);
    case Delivery::rejected: throw std::runtime_error("rejected the state offered to this worker: " + in.problem);
    default: throw std::runtime_error("the state's donor was lost during the hand-over: " + in.problem);
  }
  if (!bytes.defined()) bytes = torch::empty({0}, torch::kUInt8);
  handovers_.forget(link->peer());
  CommStats cost;
  cost.bytes_received = link->bytes_received() - before;
  cost.comm_seconds = since(start);
  charge(cost);
  return bytes;
}

}  // namespace noloco
