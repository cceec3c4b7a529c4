#include "comm/membership/membership.h"

#include <algorithm>
#include <map>
#include <set>
#include <thread>

#include <fmt/format.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "comm/store/store_outage.h"
#include "util/leave_signal.h"

namespace noloco {

namespace {

using Clock = std::chrono::steady_clock;

// How long a worker asked to stop waits on a silent partner (heartbeats come every second).
constexpr std::chrono::milliseconds kSilentWhenStopping{3000};
// How often a waiting worker reads the lists it waits on (the dead, a
// partner's exchange_reached): a meeting's watchdog asks every 20 ms, and a
// list read that often was most of what a waiting replica asked of the store.
constexpr std::chrono::milliseconds kListReadEvery{250};

namespace member = record::member;

StorePtr members_scope(const StorePtr& store, const std::string& token, const std::string& scope) {
  return run_scope(store, token, record::members(scope));
}

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

std::string peer_item(const Peer& p) {
  return p.incarnation == 0 ? std::to_string(p.rank) : fmt::format("{}.{}", p.rank, p.incarnation);
}

// Who can be a member of a group whose keys are `members`: its first `world`
// ranks, then the joiners whose state is in place, in the order they joined.
std::vector<int> candidate_ranks(c10d::Store& members, int world) {
  std::vector<int> out;
  for (int r = 0; r < world; ++r) out.push_back(r);
  for (const auto& item : list_items(read_or_empty(members, member::kJoined))) out.push_back(std::stoi(item));
  return out;
}

Peer peer_of(const std::string& item) {
  const auto dot = item.find('.');
  return {std::stoi(item.substr(0, dot)), dot == std::string::npos ? 0 : std::stoi(item.substr(dot + 1))};
}

}  // namespace

int claim_member_id(const StorePtr& store, const std::string& token, const std::string& scope, int world) {
  return world + int(members_scope(store, token, scope)->add(member::kJoiners, 1)) - 1;
}

std::vector<int> joined_members(const StorePtr& store, const std::string& token, const std::string& scope) {
  std::vector<int> out;
  for (const auto& item : list_items(read_or_empty(*members_scope(store, token, scope), member::kJoined)))
    out.push_back(std::stoi(item));
  return out;
}

int least_served_stage(const StorePtr& store, const std::string& token, int stages, int replicas) {
  int best = 0, fewest = -1;
  for (int s = 0; s < stages; ++s) {
    const auto members = members_scope(store, token, record::replica_group(stages, s));
    const std::string dead = read_or_empty(*members, member::kDead), finished = read_or_empty(*members, member::kFinished);
    // Joiners count from their claim on, so that joiners arriving together spread over the stages.
    const int claimed = members->check({member::kJoiners}) ? int(members->add(member::kJoiners, 0)) : 0;
    int live = 0;
    for (int r = 0; r < replicas + claimed; ++r)
      live += !list_has(dead, std::to_string(r)) && !list_has(finished, std::to_string(r));
    if (fewest < 0 || live < fewest) {
      best = s;
      fewest = live;
    }
  }
  return best;
}

MemberState member_state(const StorePtr& store, const std::string& token, const std::string& scope, int rank) {
  const auto members = members_scope(store, token, scope);
  if (list_has(read_or_empty(*members, member::kFinished), std::to_string(rank))) return MemberState::finished;
  if (list_has(read_or_empty(*members, member::kDead), std::to_string(rank))) return MemberState::dead;
  return MemberState::running;
}

std::string member_summary(const StorePtr& store, const std::string& token, const std::string& scope, int rank) {
  return read_or_empty(*members_scope(store, token, scope), member::summary(rank));
}

std::optional<std::string> await_member_end(const StorePtr& store, const std::string& token, const std::string& scope,
                                            int rank, int worker, HeartbeatWatch& heartbeats,
                                            double heartbeat_timeout,
                                            const std::function<std::optional<std::string>()>& given_up) {
  const auto members = members_scope(store, token, scope);
  for (;;) {
    const auto state = member_state(store, token, scope, rank);
    if (state == MemberState::finished) return std::nullopt;
    if (const auto refused = read_or_empty(*members, member::refused(rank)); !refused.empty())
      return "refused at start: " + refused;
    if (const double silent = heartbeats.silent_seconds(worker); silent > heartbeat_timeout)
      return fmt::format("{}no heartbeat for {:.0f} s", state == MemberState::dead ? "declared dead, " : "", silent);
    if (auto why = given_up()) return why;
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
}

void declare_dead(const StorePtr& store, const std::string& token, const std::string& scope, int rank) {
  append_item(*members_scope(store, token, scope), member::kDead, std::to_string(rank));
}

int64_t choose_resume_step(const std::map<int, std::vector<int64_t>>& steps_by_worker) {
  std::map<int64_t, int> holders;  // step -> how many workers hold it
  bool any = false;
  for (const auto& [worker, steps] : steps_by_worker) {
    any |= !steps.empty();
    for (const int64_t s : std::set<int64_t>(steps.begin(), steps.end())) ++holders[s];
  }
  if (!any) return 0;
  for (auto it = holders.rbegin(); it != holders.rend(); ++it)
    if (it->second == int(steps_by_worker.size())) return it->first;
  std::string held;
  for (const auto& [worker, steps] : steps_by_worker)
    held += fmt::format("{}worker {}: {}", held.empty() ? "" : ", ", worker,
                        steps.empty() ? std::string("none") : fmt::format("newest step {}", steps.back()));
  throw std::runtime_error(fmt::format(
      "resume=true: the workers hold no complete checkpoint of one common step ({}); remove the run's checkpoints "
      "to start afresh, or restore the missing ones",
      held));
}

void start_from_peer_on_resume(const StorePtr& store, const std::string& token, int worker, const RunLayout& layout) {
  const auto members = members_scope(store, token, record::replica_group(layout.stages(), layout.stage_of(worker)));
  const int replica = layout.replica_of(worker);
  // What the launcher does for a restart: the worker is dead to its stage
  // until its state is in place, and its process will be a later incarnation.
  append_item(*members, member::kDead, std::to_string(replica));
  members->add(member::started(replica), 1);
  const auto& from_peer = record::kStartsFromPeer;
  run_scope(store, token, record::kResume)
      ->set(record::resume_steps(worker), std::vector<uint8_t>(from_peer.begin(), from_peer.end()));
}

int64_t agree_resume_step(const StorePtr& store, const std::string& token, int worker, int workers,
                          const RunLayout& layout, const std::vector<int64_t>& steps,
                          std::chrono::milliseconds timeout) {
  const auto resume = run_scope(store, token, record::kResume);
  std::string mine;
  for (const int64_t s : steps) mine += std::to_string(s) + ",";
  resume->set(record::resume_steps(worker), std::vector<uint8_t>(mine.begin(), mine.end()));
  std::map<int, std::vector<int64_t>> held;
  std::set<int> from_peers;
  const auto deadline = Clock::now() + timeout;
  for (;;) {
    std::vector<int> missing;
    for (int w = 0; w < workers; ++w) {
      if (held.count(w) || from_peers.count(w)) continue;
      const std::string key = record::resume_steps(w);
      if (!resume->check({key})) {
        missing.push_back(w);
        continue;
      }
      const auto items = read_or_empty(*resume, key);
      if (items == record::kStartsFromPeer) {
        from_peers.insert(w);
        continue;
      }
      auto& list = held[w];
      for (const auto& item : list_items(items)) list.push_back(std::stoll(item));
    }
    if (missing.empty()) return choose_resume_step(held);
    for (const int w : missing)
      if (list_has(read_or_empty(*members_scope(store, token, record::replica_group(layout.stages(), layout.stage_of(w))),
                                 member::kDead),
                   std::to_string(layout.replica_of(w))))
        throw std::runtime_error(fmt::format("worker {} failed before the run agreed on the step to resume from", w));
    if (Clock::now() > deadline)
      throw std::runtime_error(fmt::format("worker {} did not say which checkpoints it holds within {} s", missing[0],
                                           timeout.count() / 1000));
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
}

Membership::Membership(StorePtr store, const WorkerEnv& env, const std::string& scope, int rank, int world,
                       std::chrono::milliseconds heartbeat_timeout, std::chrono::milliseconds idle_timeout,
                       Heartbeat* own, std::function<int(int)> worker_of)
    : store_(std::move(store)),
      members_(members_scope(store_, env.token, scope)),
      token_(env.token),
      rank_(rank),
      world_(world),
      worker_of_(worker_of ? std::move(worker_of) : [](int member) { return member; }),
      heartbeat_timeout_(heartbeat_timeout),
      idle_timeout_(idle_timeout),
      own_(own),
      heartbeats_(store_, env.token) {
  incarnation_ = int(members_->add(member::started(rank), 1)) - 1;
  joining_ = rank >= world && incarnation_ == 0;
}

std::vector<int> Membership::candidates() const { return candidate_ranks(*members_, world_); }

std::vector<Peer> Membership::snapshot(const std::string& name) {
  std::lock_guard<std::mutex> lock(mutex_);
  const std::string key = member::snapshot(name);
  std::string text = read_or_empty(*members_, key);
  if (text.empty()) {
    const std::string dead = read_or_empty(*members_, member::kDead);
    const std::string leaving = read_or_empty(*members_, member::kLeaving);
    const auto incarnations = parse_incarnations(read_or_empty(*members_, member::kIncarnations));
    std::string alive;
    for (const int r : candidates()) {
      if (list_has(dead, std::to_string(r))) continue;
      const auto g = incarnations.find(r);
      const auto item = peer_item({r, g == incarnations.end() ? 0 : g->second});
      if (!list_has(leaving, item)) alive += item + ",";
    }
    text = set_once(*members_, key, alive);
  }
  std::vector<Peer> out;
  for (const auto& item : list_items(text)) {
    const Peer p = peer_of(item);
    if (p.rank == rank_ && p.incarnation != incarnation_) continue;  // an earlier life of this replica
    out.push_back(p);
  }
  if (std::none_of(out.begin(), out.end(), [&](const Peer& p) { return p.rank == rank_; }))
    remove_item(*members_, member::kDead, std::to_string(rank_));  // alive after all: back in later snapshots
  // The dead list as last read may be older than this snapshot: a member
  // back in it (a restarted replica that took a live one's state) would be
  // given up from a list read before it came back.
  last_dead_read_ = {};
  std::sort(out.begin(), out.end(), [](const Peer& a, const Peer& b) { return a.rank < b.rank; });
  return out;
}

void Membership::begin_leaving() {
  std::lock_guard<std::mutex> lock(mutex_);
  append_item(*members_, member::kLeaving, peer_item(self()));
}

void Membership::leave() { declare_dead(rank_); }

void Membership::refuse(const std::string& why) {
  members_->set(member::refused(rank_), std::vector<uint8_t>(why.begin(), why.end()));
  declare_dead(rank_);
}

void Membership::declare_dead(int rank) {
  std::lock_guard<std::mutex> lock(mutex_);
  append_item(*members_, member::kDead, std::to_string(rank));
}

bool Membership::given_up(int rank, Clock::time_point waiting_since) {
  std::lock_guard<std::mutex> lock(mutex_);
  const auto now = Clock::now();
  if (now - last_dead_read_ > kListReadEvery) {
    last_dead_read_ = now;
    try {
      dead_ = read_or_empty(*members_, member::kDead);
    } catch (const StoreUnreachable&) {  // the last list read stands; silence is not counted meanwhile
    }
  }
  if (list_has(dead_, std::to_string(rank))) return true;
  const auto& s = silence_of(rank, now);
  // Progress is published and read once a second each: below 3 s, idle
  // cannot be told from the lag of the publishing.
  const auto idle_limit = std::max<Clock::duration>(std::chrono::seconds(3), idle_timeout_);
  return s.silent || now - std::max(s.moved, waiting_since) > idle_limit;
}

void Membership::reach_exchange(int64_t id) {
  std::lock_guard<std::mutex> lock(mutex_);
  exchange_ = id;
  if (store_outage().ongoing()) return;  // partners waiting for it meanwhile find it by its silence, or later here
  const auto text = alone_.text(id);
  members_->set(member::exchange_reached(rank_), std::vector<uint8_t>(text.begin(), text.end()));
}

void Membership::go_alone(int64_t id) {
  std::lock_guard<std::mutex> lock(mutex_);
  alone_.add(id);
}

bool Membership::went_alone(int rank, int64_t id, bool or_later) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto& r = reached_[rank];
  const auto now = Clock::now();
  if (now - r.read > kListReadEvery) {
    r.read = now;
    try {
      r.alone = ExchangeRanges::parse(read_or_empty(*members_, member::exchange_reached(rank)));
    } catch (const StoreUnreachable&) {
    }
  }
  return or_later ? r.alone.any_from(id) : r.alone.covers(id);
}

int64_t Membership::exchange_reached() {
  std::lock_guard<std::mutex> lock(mutex_);
  return exchange_;
}

bool Membership::silent(int rank) {
  std::lock_guard<std::mutex> lock(mutex_);
  return silence_of(rank, Clock::now()).silent;
}

const Membership::Silence& Membership::silence_of(int rank, Clock::time_point now) {
  auto& s = silence_[rank];
  if (now - s.checked > std::chrono::seconds(1)) {
    s.checked = now;
    const int worker = worker_of_(rank);
    // Asked to stop (SIGTERM), a worker gives a silent partner a few beats,
    // not the hung-worker allowance: under torchrun the agent stops every
    // worker once one died, and nobody declares the dead one dead.
    const auto allowed = leave_requested() ? std::min(heartbeat_timeout_, kSilentWhenStopping) : heartbeat_timeout_;
    try {
      s.silent = heartbeats_.silent_seconds(worker) * 1000 > double(allowed.count());
      const std::chrono::duration<double> idle(heartbeats_.idle_seconds(worker));
      s.moved = now - std::chrono::duration_cast<Clock::duration>(idle);
    } catch (const StoreUnreachable&) {  // nothing is judged while the store is away; a link in use goes on
      s.silent = false;
      s.moved = now;
    }
  }
  return s;
}

std::string Membership::request_name() const {
  const auto life = fmt::format("{}.{}", rank_, incarnation_);
  return renewals_ == 0 ? life : fmt::format("{}.renewed{}", life, renewals_);
}

std::string Membership::handover_channel() const { return request_name(); }

// "name" items, or "name@step" for a renewal: served by a replica at `step` or later.
int Membership::request_state(std::chrono::milliseconds timeout) {
  const std::string me = request_name();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    append_item(*members_, member::kRejoin, renewals_ == 0 ? me : fmt::format("{}@{}", me, renewed_at_step_));
  }
  // A live replica claims the request at its next outer step; until then,
  // make sure one is left that could.
  const auto deadline = Clock::now() + timeout;
  for (;;) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (members_->check({member::donor(me)})) {
        const auto donor = members_->get(member::donor(me));  // "rank.incarnation"
        return std::stoi(std::string(donor.begin(), donor.end()));
      }
      const auto dead = read_or_empty(*members_, member::kDead), finished = read_or_empty(*members_, member::kFinished);
      bool anyone = false, someone_finished = false;
      for (const int r : candidates()) {
        if (r == rank_) continue;
        const bool done = list_has(finished, std::to_string(r));
        someone_finished |= done;
        anyone |= !done && !list_has(dead, std::to_string(r));
      }
      if (!anyone)
        throw std::runtime_error(someone_finished ? "the run finished before this worker could rejoin it"
                                                  : "no live replica is left to rejoin from");
    }
    if (Clock::now() > deadline)
      throw std::runtime_error(fmt::format("no live replica handed over its state within {} s", timeout.count() / 1000));
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

void Membership::rejoined() {
  std::lock_guard<std::mutex> lock(mutex_);
  append_item(*members_, member::kIncarnations, fmt::format("{}.{}", rank_, incarnation_));
  if (joining_) append_item(*members_, member::kJoined, std::to_string(rank_));
  joining_ = false;
  remove_item(*members_, member::kDead, std::to_string(rank_));
}

std::vector<std::pair<int, std::string>> Membership::claim_requests(int64_t step) {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<std::pair<int, std::string>> won;
  for (const auto& item : list_items(read_or_empty(*members_, member::kRejoin))) {
    const auto at = item.find('@');
    const auto request = item.substr(0, at);
    if (at != std::string::npos && std::stoll(item.substr(at + 1)) > step) continue;  // asked of one further on
    if (!seen_requests_.insert(request).second) continue;
    const int who = std::stoi(request.substr(0, request.find('.')));
    if (who == rank_) continue;
    // Claimed as this incarnation: a restarted replica must not take a request
    // that its earlier life claimed (and served) for its own.
    const auto mine = request_name();
    if (set_once(*members_, member::donor(request), mine) != mine) continue;  // another replica serves it
    won.emplace_back(who, request);
  }
  return won;
}

// "r.g@k" items: replica r in incarnation g sent a diverged message at outer step k.
void Membership::refuse_as_diverged(const Peer& partner, int64_t outer_step) {
  std::lock_guard<std::mutex> lock(mutex_);
  try {
    append_item(*members_, member::kDiverged, fmt::format("{}.{}@{}", partner.rank, partner.incarnation, outer_step));
  } catch (const StoreUnreachable&) {  // its message is refused all the same; the next refusal tells it
  }
}

bool Membership::refused_as_diverged() {
  std::lock_guard<std::mutex> lock(mutex_);
  const auto me = fmt::format("{}.{}@", rank_, incarnation_);
  std::string refusals;
  try {
    refusals = read_or_empty(*members_, member::kDiverged);
  } catch (const StoreUnreachable&) {  // a refusal stays in the store: read after an outer step once it answers
    return false;
  }
  for (const auto& item : list_items(refusals))
    if (item.rfind(me, 0) == 0 && std::stoll(item.substr(me.size())) > refusals_answered_) return true;
  return false;
}

void Membership::renew(int64_t outer_step, int64_t step) {
  std::lock_guard<std::mutex> lock(mutex_);
  refusals_answered_ = outer_step;
  renewed_at_step_ = step;
  ++renewals_;
  append_item(*members_, member::kDead, std::to_string(rank_));  // out of snapshots until rejoined()
}

void Membership::finish(const std::string& summary) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!summary.empty()) members_->set(member::summary(rank_), std::vector<uint8_t>(summary.begin(), summary.end()));
  append_item(*members_, member::kFinished, std::to_string(rank_));
}

std::vector<int> Membership::still_training() {
  const auto dead = read_or_empty(*members_, member::kDead), finished = read_or_empty(*members_, member::kFinished);
  std::vector<int> out;
  for (const int r : candidates())
    if (r != rank_ && !list_has(dead, std::to_string(r)) && !list_has(finished, std::to_string(r)) && !silent(r))
      out.push_back(r);
  return out;
}

bool Roster::holds(int stage, const Peer& p) const {
  const auto& live = stages.at(size_t(stage));
  return std::find(live.begin(), live.end(), p) != live.end();
}

bool Roster::whole(int replicas) const {
  return std::all_of(stages.begin(), stages.end(), [&](const auto& live) {
    for (int r = 0; r < replicas; ++r)
      if (std::none_of(live.begin(), live.end(), [&](const Peer& p) { return p.rank == r; })) return false;
    return true;
  });
}

PipelineRoster::PipelineRoster(StorePtr store, const std::string& token, int stages, int replicas,
                               std::chrono::milliseconds heartbeat_timeout)
    : store_(std::move(store)),
      rosters_(run_scope(store_, token, record::kRosters)),
      token_(token),
      stages_(stages),
      replicas_(replicas),
      layout_(stages, 1, std::max(1, replicas)),
      heartbeat_timeout_(heartbeat_timeout),
      heartbeats_(store_, token) {}

Roster PipelineRoster::snapshot(const std::string& name) {
  std::lock_guard<std::mutex> lock(mutex_);
  try {
    return take_snapshot(name);
  } catch (const StoreUnreachable&) {
    // Through a store outage the pipeline routes over the workers it last knew.
    if (!last_) throw;
    return *last_;
  }
}

Roster PipelineRoster::take_snapshot(const std::string& name) {
  std::string text = read_or_empty(*rosters_, name);
  if (text.empty()) {
    for (int s = 0; s < stages_; ++s) {
      const auto members = members_scope(store_, token_, record::replica_group(stages_, s));
      const std::string dead = read_or_empty(*members, member::kDead), lost = read_or_empty(*members, member::kLost);
      const auto incarnations = parse_incarnations(read_or_empty(*members, member::kIncarnations));
      for (const int r : candidate_ranks(*members, replicas_)) {
        const auto g = incarnations.find(r);
        const Peer p{r, g == incarnations.end() ? 0 : g->second};
        if (!list_has(dead, std::to_string(r)) && !list_has(lost, fmt::format("{}.{}", r, p.incarnation)))
          text += peer_item(p) + ",";
      }
      text += "|";
    }
    text = set_once(*rosters_, name, text);
  }
  // What was read before this roster may be older than it (a restarted
  // worker's death mark, cleared before the roster listed it).
  records_.clear();
  silence_.clear();
  Roster roster;
  roster.stages.resize(size_t(stages_));
  size_t stage = 0, from = 0;
  for (size_t bar = text.find('|'); bar != std::string::npos && stage < roster.stages.size();
       from = bar + 1, bar = text.find('|', from), ++stage)
    for (const auto& item : list_items(text.substr(from, bar - from))) roster.stages[stage].push_back(peer_of(item));
  last_ = roster;
  return roster;
}

const PipelineRoster::StageRecord& PipelineRoster::record_of(int stage) {
  auto& r = records_[stage];
  const auto now = Clock::now();
  if (now - r.read > std::chrono::seconds(1)) {
    const auto members = members_scope(store_, token_, record::replica_group(stages_, stage));
    try {
      r = {now, read_or_empty(*members, member::kDead), read_or_empty(*members, member::kLost)};
    } catch (const StoreUnreachable&) {  // the last lists read stand
      r.read = now;
    }
  }
  return r;
}

std::optional<int> PipelineRoster::listed_incarnation(int worker) const {
  if (!last_) return std::nullopt;
  for (const auto& p : last_->stages.at(size_t(layout_.stage_of(worker))))
    if (p.rank == layout_.replica_of(worker)) return p.incarnation;
  return std::nullopt;
}

bool PipelineRoster::silent_locked(int worker) {
  auto& [checked, silent] = silence_[worker];
  const auto now = Clock::now();
  if (now - checked > std::chrono::seconds(1)) {
    checked = now;
    try {
      silent = heartbeats_.silent_seconds(worker) * 1000 > double(heartbeat_timeout_.count());
    } catch (const StoreUnreachable&) {
      silent = false;
    }
  }
  return silent;
}

bool PipelineRoster::given_up(int worker, Clock::time_point) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!last_) return false;
  const auto incarnation = listed_incarnation(worker);
  if (!incarnation) return true;
  const auto& record = record_of(layout_.stage_of(worker));
  const int replica = layout_.replica_of(worker);
  return list_has(record.dead, std::to_string(replica)) ||
         list_has(record.lost, fmt::format("{}.{}", replica, *incarnation)) || silent_locked(worker);
}

bool PipelineRoster::silent(int worker) {
  std::lock_guard<std::mutex> lock(mutex_);
  return silent_locked(worker);
}

void PipelineRoster::declare_dead(int worker) {
  std::lock_guard<std::mutex> lock(mutex_);
  const auto incarnation = listed_incarnation(worker);
  if (!incarnation) return;  // not in the last roster: already left out
  const int stage = layout_.stage_of(worker);
  const auto item = fmt::format("{}.{}", layout_.replica_of(worker), *incarnation);
  append_item(*members_scope(store_, token_, record::replica_group(stages_, stage)), member::kLost, item);
  auto& record = records_[stage];
  record.lost += item + ",";  // asked before the next read: already lost
}

}  // namespace noloco
