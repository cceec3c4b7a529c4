#include "train/run_summary.h"

#include <cmath>
#include <filesystem>

#include <fmt/format.h>

#include "train/metrics.h"
#include "util/files.h"

namespace noloco {

nlohmann::json summarize_run(const std::string& out, const std::string& method, int replicas,
                             const std::vector<WorkerExit>& exits, double seconds) {
  nlohmann::json finished = nlohmann::json::array(), failed = nlohmann::json::array();
  nlohmann::json losses = nlohmann::json::array();
  double loss_sum = 0, comm = 0, wait = 0;
  uint64_t sent = 0, received = 0;
  int64_t collectives = 0, tokens = 0;
  nlohmann::json first;
  for (const auto& e : exits) {
    const auto path = fmt::format("{}/summary_r{}.json", out, e.rank);
    if (!e.ok() || !std::filesystem::exists(path)) {
      failed.push_back({{"replica", e.rank}, {"reason", e.describe()}, {"seconds", e.seconds}});
      continue;
    }
    const auto s = read_json(path);
    if (first.is_null()) first = s;
    finished.push_back(e.rank);
    losses.push_back(s.at("final_val_loss"));
    loss_sum += s.at("final_val_loss").get<double>();
    sent += s.value("bytes_sent", uint64_t(0));
    received += s.value("bytes_received", uint64_t(0));
    comm += s.value("comm_seconds", 0.0);
    wait += s.value("wait_seconds", 0.0);
    collectives += s.value("collectives", int64_t(0));
    tokens += s.value("tokens", int64_t(0));
  }
  const double n = double(std::max<size_t>(1, finished.size()));
  nlohmann::json summary = {{"method", method},
                            {"replicas", replicas},
                            {"replicas_finished", finished},
                            {"replicas_failed", failed},
                            {"final_val_loss", finished.empty() ? nlohmann::json() : nlohmann::json(loss_sum / n)},
                            {"final_val_loss_replicas", losses},
                            {"bytes_sent", sent},
                            {"bytes_received", received},
                            {"comm_seconds", comm},
                            {"wait_seconds", wait},
                            {"comm_seconds_per_replica", comm / n},
                            {"wait_seconds_per_replica", wait / n},
                            {"collectives", collectives},
                            {"tokens", tokens},
                            {"seconds", seconds}};
  if (!first.is_null()) {
    for (auto key : {"steps", "params", "final_val_loss_mean_model", "weight_std"})
      if (first.contains(key)) summary[key] = first[key];
  }
  return summary;
}

std::string comparison_table(const std::vector<std::string>& run_dirs) {
  std::string t =
      "| run | method | replicas | final val loss | ppl | mean-model val loss | weight std | training bytes | "
      "comm s/replica | wait s/replica | collectives | wall s |\n"
      "|---|---|---|---|---|---|---|---|---|---|---|---|\n";
  auto num = [](const nlohmann::json& s, const char* key, const char* format) -> std::string {
    if (!s.contains(key) || !s[key].is_number()) return "–";
    return fmt::format(fmt::runtime(format), s[key].get<double>());
  };
  for (const auto& dir : run_dirs) {
    const auto s = read_json(dir + "/summary.json");
    const double loss = s.value("final_val_loss", std::nan(""));
    t += fmt::format("| {} | {} | {} | {} | {:.2f} | {} | {} | {} | {} | {} | {} | {} |\n",
                     std::filesystem::path(dir).filename().string(), s.value("method", "?"), s.value("replicas", 1),
                     num(s, "final_val_loss", "{:.4f}"), std::exp(loss), num(s, "final_val_loss_mean_model", "{:.4f}"),
                     num(s, "weight_std", "{:.2e}"), format_count(double(s.value("bytes_sent", uint64_t(0)))),
                     num(s, "comm_seconds_per_replica", "{:.1f}"), num(s, "wait_seconds_per_replica", "{:.1f}"),
                     s.value("collectives", int64_t(0)), num(s, "seconds", "{:.0f}"));
  }
  return t;
}

}  // namespace noloco
