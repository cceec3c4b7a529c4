#include "optim/pace.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>

#include <fmt/format.h>
#include <torch/torch.h>

namespace noloco {

namespace {
// Weight of the newest step in the step-time average: it follows a machine
// that slows down within a few tens of steps, and one slow step moves it little.
constexpr double kStepTimeSmoothing = 0.05;
}  // namespace

std::vector<uint8_t> PaceReport::to_bytes() const {
  std::vector<uint8_t> out(kBytes);
  const int64_t words[5] = {steps, 0, reference_rank, 0, reference_heard_at};
  std::memcpy(out.data(), words, sizeof(words));
  std::memcpy(out.data() + 8, &step_seconds, 8);
  std::memcpy(out.data() + 24, &reference_seconds, 8);
  return out;
}

PaceReport PaceReport::from_bytes(const uint8_t* bytes, int64_t size) {
  if (size != kBytes) throw std::runtime_error(fmt::format("a pace report has {} bytes, not {}", size, kBytes));
  PaceReport r;
  std::memcpy(&r.steps, bytes, 8);
  std::memcpy(&r.step_seconds, bytes + 8, 8);
  std::memcpy(&r.reference_rank, bytes + 16, 8);
  std::memcpy(&r.reference_seconds, bytes + 24, 8);
  std::memcpy(&r.reference_heard_at, bytes + 32, 8);
  const auto time_ok = [](double s) { return std::isfinite(s) && s >= 0 && s < 1e6; };
  if (r.steps < 1 || r.steps > (int64_t(1) << 40) || !time_ok(r.step_seconds) || !time_ok(r.reference_seconds) ||
      r.reference_rank < -1 || r.reference_rank > (int64_t(1) << 30) || r.reference_heard_at < 0)
    throw std::runtime_error("a pace report holds values out of range");
  return r;
}

Pace::Pace(int64_t interval, int rank) : interval_(interval), rank_(rank) {
  if (interval < 1) throw std::invalid_argument("a pace needs an outer interval >= 1");
}

std::map<int, Pace::Heard>::const_iterator Pace::fastest() const {
  auto best = heard_.end();
  for (auto it = heard_.begin(); it != heard_.end(); ++it) {
    if (it->second.at + kReferenceHorizon < latest_outer_step_ || !(it->second.seconds > 0)) continue;
    if (best == heard_.end() || it->second.seconds < best->second.seconds) best = it;
  }
  return best;
}

double Pace::reference_seconds() const {
  const auto best = fastest();
  if (best == heard_.end()) return step_seconds_;
  return step_seconds_ > 0 ? std::min(step_seconds_, best->second.seconds) : best->second.seconds;
}

int64_t Pace::period_steps() const { return std::llround(share_ * double(interval_)); }

bool Pace::trains_at(int64_t step) {
  if (step % interval_ == 0) {
    share_ = pace_share(step_seconds_, reference_seconds(), interval_);
  }
  bool trains = false;
  if (step >= replay_from_ && step - replay_from_ < int64_t(replay_.size())) {
    trains = replay_[size_t(step - replay_from_)];
  } else if (catching_up_ > 0) {
    --catching_up_;
  } else {
    // The epsilon: three thirds summed in doubles may fall a hair short of one.
    credit_ += share_;
    trains = credit_ >= 1 - 1e-9;
    if (trains) credit_ = std::max(0.0, credit_ - 1);
  }
  window_.push_back(trains);
  if (int64_t(window_.size()) > interval_) window_.pop_front();
  return trains;
}

void Pace::step_took(double seconds) {
  ++trained_steps_;
  if (!(seconds >= 0) || !std::isfinite(seconds)) return;
  step_seconds_ = step_seconds_ > 0 ? (1 - kStepTimeSmoothing) * step_seconds_ + kStepTimeSmoothing * seconds : seconds;
}

PaceReport Pace::report(int64_t outer_step) const {
  PaceReport r;
  r.steps = std::max<int64_t>(1, std::count(window_.begin(), window_.end(), true));
  r.step_seconds = step_seconds_;
  const auto best = fastest();
  if (best != heard_.end() && !(step_seconds_ > 0 && step_seconds_ <= best->second.seconds)) {
    r.reference_rank = best->first;
    r.reference_seconds = best->second.seconds;
    r.reference_heard_at = best->second.at;
  } else {
    r.reference_rank = rank_;
    r.reference_seconds = step_seconds_;
    r.reference_heard_at = outer_step;
  }
  return r;
}

void Pace::fell_behind(double seconds) {
  if (interval_ < 2) return;  // a period of one slot has none to skip
  const double slots = step_seconds_ > 0 ? std::ceil(seconds / step_seconds_) : 1;
  catching_up_ = std::clamp<int64_t>(int64_t(slots), 1, interval_ - 1);
}

void Pace::replay(int64_t from, std::vector<bool> slots) {
  replay_from_ = from;
  replay_ = std::move(slots);
}

void Pace::hear(int rank, const PaceReport& report, int64_t outer_step) {
  latest_outer_step_ = std::max(latest_outer_step_, outer_step);
  if (rank != rank_) heard_[rank] = {report.step_seconds, outer_step};
  const int referred = int(report.reference_rank);
  if (referred < 0 || referred == rank_ || referred == rank) return;
  auto& known = heard_[referred];
  if (report.reference_heard_at >= known.at) known = {report.reference_seconds, report.reference_heard_at};
}

void Pace::save(TensorMap& out) const {
  std::vector<double> heard;
  for (const auto& [rank, h] : heard_) heard.insert(heard.end(), {double(rank), h.seconds, double(h.at)});
  out["pace.state"] = torch::tensor(
      {share_, credit_, step_seconds_, double(latest_outer_step_), double(trained_steps_), double(catching_up_)},
      torch::kFloat64);
  out["pace.heard"] = torch::tensor(heard, torch::kFloat64).reshape({int64_t(heard_.size()), 3});
  std::vector<int64_t> window(window_.begin(), window_.end());
  out["pace.window"] = torch::tensor(window, torch::kInt64);
}

void Pace::load(const TensorMap& in) {
  const auto state = in.find("pace.state");
  if (state == in.end()) return;  // saved with pace=steps: the first period starts at full pace
  const auto s = state->second.to(torch::kFloat64).reshape({-1});
  // Five values: a checkpoint that holds no catch-up count (none under way).
  TORCH_CHECK(s.numel() == 5 || s.numel() == 6, "pace.state has ", s.numel(), " values, expected 6");
  share_ = std::clamp(s[0].item<double>(), 1.0 / double(interval_), 1.0);
  credit_ = std::clamp(s[1].item<double>(), 0.0, 1.0);
  step_seconds_ = s[2].item<double>();
  latest_outer_step_ = int64_t(s[3].item<double>());
  trained_steps_ = int64_t(s[4].item<double>());
  catching_up_ = s.numel() == 6 ? std::clamp<int64_t>(int64_t(s[5].item<double>()), 0, interval_ - 1) : 0;
  heard_.clear();
  if (const auto h = in.find("pace.heard"); h != in.end() && h->second.numel() > 0) {
    const auto rows = h->second.to(torch::kFloat64).reshape({-1, 3});
    for (int64_t i = 0; i < rows.size(0); ++i)
      heard_[int(rows[i][0].item<double>())] = {rows[i][1].item<double>(), int64_t(rows[i][2].item<double>())};
  }
  window_.clear();
  if (const auto w = in.find("pace.window"); w != in.end())
    for (int64_t i = 0; i < w->second.numel() && i < interval_; ++i)
      window_.push_back(w->second.reshape({-1})[i].item<int64_t>() != 0);
}

bool is_pace_state(const std::string& name) { return name.rfind("pace.", 0) == 0; }

}  // namespace noloco
