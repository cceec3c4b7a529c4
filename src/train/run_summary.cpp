#include "train/run_summary.h"

#include <cmath>
#include <filesystem>

#include <fmt/format.h>

#include "train/metrics.h"
#include "util/files.h"

namespace noloco {

double spread_over_stages(const std::vector<std::pair<double, double>>& stages) {
  double var_sum = 0, params = 0;
  for (const auto& [n, std_dev] : stages) {
    var_sum += n * std_dev * std_dev;
    params += n;
  }
  return params > 0 ? std::sqrt(var_sum / params) : std::nan("");
}

nlohmann::json summarize_run(const std::string& out, const TrainConfig& c, const std::vector<WorkerExit>& exits,
                             double seconds) {
  const int stages = int(c.stages);
  nlohmann::json finished = nlohmann::json::array(), failed = nlohmann::json::array();
  nlohmann::json restarted = nlohmann::json::array();
  nlohmann::json losses = nlohmann::json::array();
  double loss_sum = 0, comm = 0, wait = 0;
  uint64_t sent = 0, received = 0, activation_bytes = 0;
  int64_t collectives = 0, tokens = 0;
  nlohmann::json first, mean_model_loss;
  // Per stage: (parameters, weight std) of one of its replicas, and the replicas' idle seconds.
  std::vector<std::pair<double, double>> stage_spread(size_t(stages), {0.0, std::nan("")});
  std::vector<std::vector<double>> stage_idle(static_cast<size_t>(stages));
  for (const auto& e : exits) {
    const auto path = fmt::format("{}/summary_r{}.json", out, e.rank);
    auto where = [&](nlohmann::json j) {
      if (stages > 1) j.update({{"worker", e.rank}, {"stage", e.rank % stages}});
      j["replica"] = e.rank / stages;
      return j;
    };
    if (e.restarted) {  // its next start decides whether it finished
      restarted.push_back(where({{"reason", e.describe()}, {"seconds", e.seconds}}));
      continue;
    }
    if (!e.ok() || !std::filesystem::exists(path)) {
      failed.push_back(where({{"reason", e.describe()}, {"seconds", e.seconds}}));
      continue;
    }
    const auto s = read_json(path);
    if (first.is_null()) first = s;
    finished.push_back(stages > 1 ? e.rank : e.rank / stages);
    if (s.contains("final_val_loss")) {  // the workers that compute the loss: one per replica
      losses.push_back(s["final_val_loss"]);
      loss_sum += s["final_val_loss"].get<double>();
      tokens += s.value("tokens", int64_t(0));
    }
    if (s.contains("final_val_loss_mean_model")) mean_model_loss = s["final_val_loss_mean_model"];
    sent += s.value("bytes_sent", uint64_t(0));
    received += s.value("bytes_received", uint64_t(0));
    comm += s.value("comm_seconds", 0.0);
    wait += s.value("wait_seconds", 0.0);
    collectives += s.value("collectives", int64_t(0));
    activation_bytes += s.value("activation_bytes_sent", uint64_t(0));
    auto& spread = stage_spread[size_t(e.rank % stages)];
    if (s.contains("weight_std") && std::isnan(spread.second))
      spread = {s.value("stage_params", s.value("params", 0.0)), s["weight_std"].get<double>()};
    stage_idle[size_t(e.rank % stages)].push_back(s.value("pipeline_idle_seconds", 0.0));
  }
  const double workers = double(std::max<size_t>(1, finished.size()));
  nlohmann::json summary = {{"method", c.method},
                            {"replicas", c.replicas},
                            {"replicas_finished", finished},
                            {"replicas_failed", failed},
                            {"replicas_restarted", restarted},
                            {"final_val_loss", losses.empty() ? nlohmann::json() : nlohmann::json(loss_sum / double(losses.size()))},
                            {"final_val_loss_replicas", losses},
                            {"bytes_sent", sent},
                            {"bytes_received", received},
                            {"comm_seconds", comm},
                            {"wait_seconds", wait},
                            {"comm_seconds_per_replica", comm / workers},
                            {"wait_seconds_per_replica", wait / workers},
                            {"collectives", collectives},
                            {"tokens", tokens},
                            {"seconds", seconds}};
  if (!first.is_null()) {
    for (auto key : {"steps", "params"})
      if (first.contains(key)) summary[key] = first[key];
  }
  if (!mean_model_loss.is_null()) summary["final_val_loss_mean_model"] = mean_model_loss;
  const double spread = spread_over_stages(stage_spread);
  if (!std::isnan(spread)) summary["weight_std"] = spread;
  if (stages > 1) {
    nlohmann::json idle = nlohmann::json::array();
    for (const auto& per_replica : stage_idle) {
      double sum = 0;
      for (double x : per_replica) sum += x;
      idle.push_back(per_replica.empty() ? 0.0 : sum / double(per_replica.size()));
    }
    summary.update({{"stages", stages},
                    {"routing", c.routing},
                    {"micro_batches", c.grad_accum},
                    {"activation_bytes_sent", activation_bytes},
                    {"activation_bytes_per_step", double(activation_bytes) / double(c.steps)},
                    {"pipeline_idle_seconds_per_stage", idle}});
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
