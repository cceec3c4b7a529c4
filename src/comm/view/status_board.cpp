#include "comm/view/status_board.h"

#include <pthread.h>
#include <unistd.h>

#include <algorithm>
#include <thread>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "comm/store/store_traffic.h"
#include "comm/transport/seal.h"
#include "util/error_text.h"
#include "util/parse_number.h"
#include "util/process_stats.h"

namespace noloco {

namespace {

// Seal contexts are words; this one tells status entries apart from every message kind.
constexpr int64_t kStatusSealKind = 0x5354415455530001;  // "STATUS", 1

void copy_number(nlohmann::json& to, const nlohmann::json& from, const char* key, const char* as = nullptr) {
  const auto it = from.find(key);
  if (it != from.end() && it->is_number()) to[as ? as : key] = *it;
}

void add_event(std::vector<nlohmann::json>& points, int64_t step, const std::string& what) {
  points.push_back({{"kind", "event"}, {"step", step}, {"what", what}, {"time", unix_seconds()}});
}


}  // namespace

std::vector<uint8_t> status_entry_context(int rank, int64_t number) {
  return seal_context({kStatusSealKind, rank, number});
}

void fold_record(nlohmann::json& status, std::vector<nlohmann::json>& points, const nlohmann::json& r) {
  const std::string split = r.value("split", "");
  const int64_t step = r.value("step", int64_t(0));
  status["step"] = step;
  status["time"] = unix_seconds();
  for (const char* key : {"bytes_sent", "bytes_relayed", "bytes_punched", "wait_seconds", "activation_bytes_sent",
                          "activation_bytes_relayed"})
    copy_number(status, r, key);
  if (split == "train") {
    copy_number(status, r, "loss");
    copy_number(status, r, "tokens_per_s");
  } else if (split == "val") {
    if (r.contains("loss")) {
      copy_number(status, r, "loss", "val_loss");
      copy_number(status, r, "loss_mean_model", "mean_loss");
      nlohmann::json point = {{"kind", "val"}, {"step", step}, {"loss", r["loss"]}, {"bytes", r.value("bytes_sent", 0)}};
      copy_number(point, r, "loss_mean_model", "mean_loss");
      points.push_back(std::move(point));
    }
    // The replicas' spread: a run's figure, the same on each replica that measured it.
    if (r.contains("weight_std") && r["weight_std"].is_number())
      points.push_back({{"kind", "spread"}, {"step", step}, {"weight_std", r["weight_std"]}});
  } else if (split == "outer") {
    const int replica = r.value("replica", 0);
    std::vector<int> partners;
    for (const auto& member : r.value("group", std::vector<int>{}))
      if (member != replica) partners.push_back(member);
    status["partner"] = partners.empty() ? nlohmann::json() : nlohmann::json(partners.front());
    const auto routes = r.value("routes", nlohmann::json::object());
    const auto route = partners.empty() ? routes.end() : routes.find(std::to_string(partners.front()));
    status["route"] = route == routes.end() ? nlohmann::json() : *route;
    status["outer_step"] = r.value("outer_step", int64_t(0));
    copy_number(status, r, "trained_steps", "period_steps");  // pace=speed: its steps in the last period
    points.push_back({{"kind", "outer"}, {"step", step}, {"outer_step", status["outer_step"]}, {"with", partners}});
  } else if (split == "join") {
    add_event(points, step, fmt::format("joined (state from replica {})", r.value("donor", -1)));
  } else if (split == "rejoin") {
    add_event(points, step, fmt::format("took replica {}'s state", r.value("donor", -1)));
  } else if (split == "donate") {
    add_event(points, step,
              fmt::format("{} its state to replica {}", r.value("abandoned", false) ? "could not hand" : "handed",
                          r.value("to", -1)));
  }
}

StatusPublisher::StatusPublisher(StorePtr store, const std::string& token, nlohmann::json identity,
                                 std::chrono::milliseconds interval)
    : store_(std::move(store)),
      seal_(std::make_unique<Seal>(token)),
      rank_(identity.value("rank", 0)),
      interval_(interval),
      status_(std::move(identity)) {
  const int incarnation = status_.value("incarnation", 0);
  add_event(points_, 0, incarnation > 0 ? fmt::format("restarted ({})", incarnation) : "started");
  status_["time"] = unix_seconds();
  changed_ = urgent_ = true;
  writer_ = std::thread([this] { run(); });
  ::pthread_setname_np(writer_.native_handle(), "noloco-status");  // what it costs shows per thread (top -H)
}

StatusPublisher::~StatusPublisher() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  writer_.join();
}

void StatusPublisher::record(const nlohmann::json& r) {
  {
    std::lock_guard lock(mutex_);
    const size_t before = points_.size();
    fold_record(status_, points_, r);
    changed_ = true;
    // A validation point or an event goes out at once (they are rare): a worker killed a second later keeps it.
    for (size_t i = before; i < points_.size(); ++i) urgent_ = urgent_ || points_[i]["kind"] != "outer";
  }
  wake_.notify_all();
}

void StatusPublisher::set_state(record::WorkerState now) {
  const std::string state = record::state_name(now);
  {
    std::lock_guard lock(mutex_);
    if (status_.value("state", "") == state) return;
    status_["state"] = state;
    status_["time"] = unix_seconds();
    // Starting, joining and training show in the table; the timeline has the start and the join already.
    const bool ends = record::ends_the_worker(state);
    if (ends) add_event(points_, status_.value("step", int64_t(0)), state);
    changed_ = true;
    urgent_ = urgent_ || ends;
  }
  wake_.notify_all();
}

void StatusPublisher::flush(std::chrono::milliseconds limit) {
  std::unique_lock lock(mutex_);
  if (!changed_ && !writing_) return;
  // The entry being written may predate what is pending: then the next one is the one to wait for.
  const int64_t done = attempts_ + (writing_ && changed_ ? 2 : 1);
  urgent_ = true;
  wake_.notify_all();
  wake_.wait_for(lock, limit, [&] { return attempts_ >= done || stopping_; });
}

void StatusPublisher::run() {
  count_this_thread_as_clocked();  // it publishes at most once an interval, however fast training goes
  std::unique_lock lock(mutex_);
  auto last = std::chrono::steady_clock::now() - interval_;
  for (;;) {
    wake_.wait(lock, [this] { return changed_ || stopping_; });
    wake_.wait_until(lock, last + interval_, [this] { return urgent_ || stopping_; });
    if (!changed_) {
      if (stopping_) return;
      continue;
    }
    const auto status = status_;
    auto points = std::move(points_);
    points_.clear();
    changed_ = urgent_ = false;
    const bool final = stopping_;
    writing_ = true;
    lock.unlock();
    publish(status, points);
    last = std::chrono::steady_clock::now();
    lock.lock();
    writing_ = false;
    ++attempts_;
    wake_.notify_all();
    // What did not fit goes first next time; a stopping publisher waits for nobody.
    if (!points.empty() && !final) {
      points_.insert(points_.begin(), points.begin(), points.end());
      changed_ = true;
    }
    if (final) return;
  }
}

void StatusPublisher::publish(const nlohmann::json& status, std::vector<nlohmann::json>& points) {
  nlohmann::json entry = {{"status", status}, {"points", nlohmann::json::array()}};
  size_t size = entry.dump().size(), taken = 0;
  for (; taken < points.size(); ++taken) {
    const size_t more = points[taken].dump().size() + 1;
    if (size + more > kStatusEntryBytes) break;
    size += more;
    entry["points"].push_back(points[taken]);
  }
  const std::string plain = entry.dump();
  try {
    if (number_ == 0) {
      // A restarted worker goes on from its previous incarnation's entries, which watchers have read.
      const auto last = read_or_empty(*store_, record::status::last(rank_));
      if (!last.empty()) number_ = parse_integer("the status entry number", last);
      append_item(*store_, record::status::kMembers, std::to_string(rank_));
    }
    const int64_t number = number_ + 1;
    std::vector<uint8_t> sealed(plain.size() + Seal::kOverhead);
    seal_->seal(reinterpret_cast<const uint8_t*>(plain.data()), plain.size(), status_entry_context(rank_, number),
                sealed.data());
    store_->set(record::status::entry(rank_, number), sealed);
    const std::string text = std::to_string(number);
    store_->set(record::status::last(rank_), std::vector<uint8_t>(text.begin(), text.end()));
    if (number > kStatusEntriesKept) store_->deleteKey(record::status::entry(rank_, number - kStatusEntriesKept));
    // Named, not counted: 64 publishers adding to one counter (a compare-and-set
    // in etcd) retried each other into most of what the run asked of its store.
    const auto marker = fmt::format("{}.{}", rank_, number);
    store_->set(record::status::kChanges, std::vector<uint8_t>(marker.begin(), marker.end()));
    number_ = number;
    points.erase(points.begin(), points.begin() + ptrdiff_t(taken));
  } catch (const std::exception& e) {
    // Training goes on: the status is for watchers, and the next entry carries these points.
    static bool told = false;
    if (!told) spdlog::warn("live status not published (the page shows it late): {}", error_text(e));
    told = true;
  }
}

StatusReader::StatusReader(const std::string& token)
    : seal_(std::make_unique<Seal>(token)), id_(fmt::format("{}-{}", machine_name(), ::getpid())) {}

StatusReader::~StatusReader() = default;

std::vector<StatusEntry> StatusReader::poll(c10d::Store& scope) {
  std::vector<StatusEntry> entries;
  const auto changes = read_or_empty(scope, record::status::kChanges);
  if (changes == changes_seen_) return entries;
  changes_seen_ = changes;
  for (const auto& member : list_items(read_or_empty(scope, record::status::kMembers))) {
    const int rank = int(parse_integer("a status member", member));
    const auto last_text = read_or_empty(scope, record::status::last(rank));
    if (last_text.empty()) continue;
    const int64_t last = parse_integer("a status entry number", last_text);
    int64_t& read = read_up_to_[rank];
    for (int64_t n = std::max(read + 1, last - kStatusEntriesKept + 1); n <= last; ++n) {
      // It exists: a publisher deletes an entry only kStatusEntriesKept entries after it (minutes after `last` was read).
      const auto sealed = scope.get(record::status::entry(rank, n));
      std::string plain(sealed.size() >= Seal::kOverhead ? sealed.size() - Seal::kOverhead : 0, '\0');
      if (sealed.size() < Seal::kOverhead ||
          !seal_->open(sealed.data(), plain.size(), status_entry_context(rank, n),
                       reinterpret_cast<uint8_t*>(plain.data()))) {
        ++refused_;
        continue;
      }
      auto body = nlohmann::json::parse(plain, nullptr, false);
      if (body.is_discarded() || !body.is_object() || !body.contains("status") || !body["status"].is_object()) {
        ++refused_;
        continue;
      }
      entries.push_back({rank, n, std::move(body)});
    }
    read = std::max(read, last);
  }
  if (!listed_) append_item(scope, record::status::kWatchers, id_);
  listed_ = true;
  scope.set(record::status::watcher(id_), std::vector<uint8_t>(changes.begin(), changes.end()));
  return entries;
}

void let_watchers_catch_up(c10d::Store& scope, std::chrono::milliseconds limit) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  const auto watchers = list_items(read_or_empty(scope, record::status::kWatchers));
  if (watchers.empty()) return;
  // A watcher has read the last entries once it saw the last change, or
  // polled again since (what it then saw changes every entry).
  const auto last = read_or_empty(scope, record::status::kChanges);
  std::map<std::string, std::string> seen_before;
  for (const auto& id : watchers) seen_before[id] = read_or_empty(scope, record::status::watcher(id));
  for (;;) {
    bool all = true;
    for (const auto& id : watchers) {
      const auto seen = read_or_empty(scope, record::status::watcher(id));
      all = all && (seen == last || seen != seen_before[id]);
    }
    if (all || std::chrono::steady_clock::now() > deadline) return;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

}  // namespace noloco
