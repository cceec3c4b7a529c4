#include "comm/view/run_view.h"

#include <algorithm>

namespace noloco {

namespace {

// The page draws the pairings of the last 60 outer steps; the timeline is kept whole up to a bound.
constexpr size_t kPairingsKept = 500;
constexpr size_t kTimelineKept = 5000;
// A member's validation curve: past this many points every other older one
// goes (the curve keeps its whole span, coarser), so that the page's state is
// bounded by the members however long the run.
constexpr size_t kCurvePointsKept = 256;

bool ended(const nlohmann::json& status) { return record::ends_the_worker(status.value("state", "")); }

template <typename T>
void keep_last(std::vector<T>& items, size_t n) {
  if (items.size() > n) items.erase(items.begin(), items.end() - ptrdiff_t(n));
}

// Halves the points before the newest half of `n`, keeping the first and the newest.
template <typename T>
void thin_out(std::vector<T>& points, size_t n) {
  if (points.size() <= n) return;
  const size_t older = points.size() - n / 2;
  std::vector<T> kept;
  for (size_t i = 0; i < points.size(); ++i)
    if (i >= older || i % 2 == 0) kept.push_back(std::move(points[i]));
  points = std::move(kept);
}

}  // namespace

void RunView::add_event(int rank, const Member& m, int64_t step, const std::string& what, double time) {
  timeline_.push_back({{"time", time},
                       {"rank", rank},
                       {"replica", m.status.value("replica", rank)},
                       {"stage", m.status.value("stage", 0)},
                       {"step", step},
                       {"what", what}});
  keep_last(timeline_, kTimelineKept);
}

void RunView::add(const StatusEntry& entry, double now) {
  Member& m = members_[entry.rank];
  const auto& status = entry.body["status"];
  // An entry of a lost incarnation read late still adds its points (they were trained), and the member stays lost.
  m.status = status;
  m.heard = now;
  for (const auto& point : entry.body.value("points", nlohmann::json::array())) {
    if (!point.is_object()) continue;
    const std::string kind = point.value("kind", "");
    const int64_t step = point.value("step", int64_t(0));
    if (kind == "val") {
      m.vals.push_back({step, point.value("loss", 0.0), point.value("mean_loss", nlohmann::json()),
                        point.value("bytes", 0.0)});
      thin_out(m.vals, kCurvePointsKept);
    } else if (kind == "spread") {
      // Each replica in the sample tells the same figure: a step once.
      if (spread_.empty() || step > spread_.back()[0].get<int64_t>()) {
        spread_.push_back({step, point.value("weight_std", 0.0)});
        thin_out(spread_, kCurvePointsKept);
      }
    } else if (kind == "outer") {
      pairings_.push_back({{"outer_step", point.value("outer_step", int64_t(0))},
                           {"step", step},
                           {"replica", status.value("replica", entry.rank)},
                           {"stage", status.value("stage", 0)},
                           {"with", point.value("with", nlohmann::json::array())}});
      keep_last(pairings_, kPairingsKept);
    } else if (kind == "event") {
      add_event(entry.rank, m, step, point.value("what", ""), point.value("time", now));
    }
  }
  if (ended(status) && m.lost_incarnation == status.value("incarnation", 0)) {
    // It was leaving, not lost: the membership holds a leaving member dead until it has finished.
    m.lost_incarnation = -1;
    timeline_.erase(std::remove_if(timeline_.begin(), timeline_.end(),
                                   [&](const nlohmann::json& e) {
                                     return e["rank"] == entry.rank && e["what"] == "lost";
                                   }),
                    timeline_.end());
  }
}

void RunView::mark_lost(int rank, double now) {
  const auto it = members_.find(rank);
  if (it == members_.end() || ended(it->second.status)) return;
  Member& m = it->second;
  const int incarnation = m.status.value("incarnation", 0);
  if (m.lost_incarnation >= incarnation) return;
  m.lost_incarnation = incarnation;
  add_event(rank, m, m.status.value("step", int64_t(0)), "lost", now);
}

std::vector<nlohmann::json> RunView::running() const {
  std::vector<nlohmann::json> out;
  for (const auto& [rank, m] : members_)
    if (!ended(m.status) && m.lost_incarnation < m.status.value("incarnation", 0))
      out.push_back({{"rank", rank},
                     {"replica", m.status.value("replica", rank)},
                     {"stage", m.status.value("stage", 0)},
                     {"stages", m.status.value("stages", 1)}});
  return out;
}

void RunView::store_gone(const std::string& why) { store_gone_ = why; }
void RunView::store_back() { store_gone_.clear(); }

nlohmann::json RunView::state(double now) const {
  nlohmann::json members = nlohmann::json::array(), curves = nlohmann::json::object();
  bool all_ended = !members_.empty(), any_finished = false;
  for (const auto& [rank, m] : members_) {
    nlohmann::json row = m.status;
    row["rank"] = rank;
    if (m.lost_incarnation >= 0 && m.lost_incarnation >= m.status.value("incarnation", 0)) row["state"] = "lost";
    const auto state = row.value("state", "");
    all_ended = all_ended && (ended(row) || state == "lost");
    any_finished = any_finished || state == record::state_name(record::WorkerState::finished);
    row["heard_seconds_ago"] = std::max(0.0, now - m.heard);
    members.push_back(std::move(row));
    curves[std::to_string(rank)] = m.vals;
  }
  nlohmann::json store_members = nlohmann::json::array();
  for (const auto& s : store_members_) store_members.push_back({{"endpoint", s.endpoint}, {"up", s.up}, {"why", s.why}});
  return {{"members", members},
          {"curves", curves},
          {"spread", spread_},
          {"pairings", pairings_},
          {"timeline", timeline_},
          // A store that went away after every member ended is the run's end, not an outage.
          {"store", store_gone_.empty() ? "live" : all_ended && any_finished ? "finished" : store_gone_},
          {"store_members", store_members},
          {"refused", refused_}};
}

}  // namespace noloco
