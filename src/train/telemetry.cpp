#include "train/telemetry.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "util/human.h"
#include "util/log.h"
#include "util/tensorboard.h"
#include "util/run_files.h"

namespace noloco {

MetricsLog::MetricsLog(const std::string& path) : path_(path) {
  fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
  if (fd_ < 0) throw std::runtime_error(fmt::format("cannot open '{}': {}", path, std::strerror(errno)));
}

MetricsLog::~MetricsLog() {
  if (fd_ >= 0) ::close(fd_);
}

void MetricsLog::write(const nlohmann::json& record) {
  const std::string line = record.dump() + "\n";
  // O_APPEND and one write per record keep lines whole when replicas share the file.
  if (::write(fd_, line.data(), line.size()) != ssize_t(line.size()))
    throw std::runtime_error(fmt::format("cannot append to '{}': {}", path_, std::strerror(errno)));
}

namespace {

// Record keys shown in TensorBoard, per split, and their tags.
const std::vector<std::pair<const char*, const char*>>& tensorboard_tags(const std::string& split) {
  static const std::vector<std::pair<const char*, const char*>> train = {
      {"loss", "train/loss"},
      {"lr", "train/lr"},
      {"tokens_per_s", "train/tokens_per_s"},
      {"bytes_sent", "comm/bytes_sent"},
      {"comm_seconds", "comm/seconds"},
      {"wait_seconds", "comm/wait_seconds"},
      {"activation_bytes_sent", "pipeline/activation_bytes_sent"},
      {"pipeline_idle_seconds", "pipeline/idle_seconds"}};
  static const std::vector<std::pair<const char*, const char*>> val = {
      {"loss", "val/loss"},
      {"weight_std", "val/weight_std_across_replicas"},
      {"loss_mean_model", "val/loss_mean_of_replicas"}};
  static const std::vector<std::pair<const char*, const char*>> none;
  return split == "train" ? train : split == "val" ? val : none;
}

}  // namespace

Telemetry::Telemetry(const std::string& run_dir, int worker, int64_t total_steps, bool console,
                     std::function<void(const nlohmann::json&)> observer)
    : metrics_(run_files::in(run_dir, run_files::kMetrics)),
      tensorboard_(std::make_unique<EventWriter>(fmt::format("{}/tensorboard/replica_{}", run_dir, worker),
                                                 fmt::format("r{}", worker))),
      total_steps_(total_steps),
      console_(console),
      observer_(std::move(observer)) {}

Telemetry::~Telemetry() = default;

void Telemetry::write(const nlohmann::json& record) {
  metrics_.write(record);
  const std::string split = record.value("split", "");
  if (split == "outer") {
    std::vector<std::string> partners;
    const auto routes = record.value("routes", nlohmann::json::object());
    for (const auto& [peer, route] : routes.items()) {
      if (partners.size() == 3) {  // a DiLoCo average names everyone: the line stays a line
        partners.push_back(fmt::format("{} more", routes.size() - 3));
        break;
      }
      partners.push_back(fmt::format("{} ({})", peer, route.get<std::string>()));
    }
    const bool alone = record.value("arrived", nlohmann::json::array()).size() < 2;
    last_exchange_ = alone || partners.empty() ? "alone" : fmt::format("with {}", fmt::join(partners, ", "));
  }
  const int64_t step = record.value("step", int64_t(0));
  bool wrote = false;
  for (const auto& [key, tag] : tensorboard_tags(split)) {
    const auto it = record.find(key);
    if (it == record.end() || !it->is_number()) continue;
    tensorboard_->scalar(tag, step, it->get<double>());
    wrote = true;
  }
  if (wrote) tensorboard_->flush();
  if (console_) print(record);
  if (observer_) observer_(record);
}

void Telemetry::print(const nlohmann::json& r) const {
  const std::string split = r.value("split", "");
  auto number = [&](const char* key) { return r.value(key, std::nan("")); };
  std::string line;
  if (split == "train") {
    line = fmt::format("step {:>6}/{} | loss {:.4f} | lr {:.2e} | {} tok/s | {} elapsed | eta {}", r["step"].get<int64_t>(),
                       total_steps_, number("loss"), number("lr"), format_count(number("tokens_per_s")),
                       format_duration(number("elapsed")), format_duration(number("eta_seconds")));
    if (r.contains("bytes_sent"))
      line += fmt::format(" | sent {}B | comm {:.1f}s (wait {:.1f}s)", format_count(number("bytes_sent")),
                          number("comm_seconds"), number("wait_seconds"));
    if (r.contains("activation_bytes_sent"))
      line += fmt::format(" | activations {}B | pipeline idle {:.1f}s", format_count(number("activation_bytes_sent")),
                          number("pipeline_idle_seconds"));
    if (r.contains("period_steps"))
      line += fmt::format(" | pace {}/{} steps ({:.3f}s a step, fastest {:.3f}s)", r["period_steps"].get<int64_t>(),
                          r["outer_interval"].get<int64_t>(), number("step_seconds"), number("reference_step_seconds"));
    if (!last_exchange_.empty()) line += " | last outer step " + last_exchange_;
  } else if (split == "val") {
    if (!r.contains("loss") && !r.contains("weight_std")) return;  // a run without validation, alone
    line = fmt::format("eval step {}", r["step"].get<int64_t>());
    if (r.contains("loss")) line += fmt::format(" | val loss {:.4f} | ppl {:.2f}", number("loss"), std::exp(number("loss")));
    if (r.contains("loss_mean_model"))
      line += fmt::format(" | mean-of-replicas val loss {:.4f}", number("loss_mean_model"));
    if (r.contains("weight_std")) line += fmt::format(" | weight std {:.3e}", number("weight_std"));
  } else {
    return;
  }
  spdlog::info("{}", line);
}

}  // namespace noloco
