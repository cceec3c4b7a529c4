#include "train/model_choice.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "util/run_files.h"

namespace noloco {

std::optional<std::pair<int, double>> best_replica(const ValidatedModels& v) {
  const auto best = std::min_element(v.replica_loss.begin(), v.replica_loss.end(),
                                     [](const auto& a, const auto& b) { return a.second < b.second; });
  if (best == v.replica_loss.end()) return std::nullopt;
  return *best;
}

ModelChoice choose_model(const ValidatedModels& v) {
  const auto found = best_replica(v);
  if (!found) return {std::nullopt, "the mean of its replicas, no validation to choose by"};
  const auto [best, loss] = *found;
  const auto best_line = fmt::format("its best replica ({}) {:.4f}", best, loss);
  if (v.mean_model_loss && *v.mean_model_loss <= loss + kLossRounding * std::abs(loss))
    return {std::nullopt, fmt::format("the mean of its replicas: validation loss {:.4f}, {}", *v.mean_model_loss,
                                      best_line)};
  if (v.replica_loss.size() == 1 && !v.mean_model_loss) return {std::nullopt, "its one replica"};
  if (v.mean_model_loss)
    return {best, fmt::format("replica {}: validation loss {:.4f}, the mean of its replicas {:.4f}"
                              "; replica=mean takes the mean all the same",
                              best, loss, *v.mean_model_loss)};
  return {best, fmt::format("replica {}: validation loss {:.4f}, the best; the mean of its replicas was not "
                            "validated there; replica=mean takes it all the same",
                            best, loss)};
}

std::map<int64_t, ValidatedModels> validated_models(const std::string& run_dir) {
  std::map<int64_t, ValidatedModels> by_step;
  std::ifstream in(run_files::in(run_dir, run_files::kMetrics));
  std::string line;
  while (std::getline(in, line)) {
    if (line.find("\"val\"") == std::string::npos) continue;  // most records are training steps
    const auto r = nlohmann::json::parse(line, nullptr, false);
    if (!r.is_object() || r.value("split", "") != "val" || !r.contains("step")) continue;
    const auto number = [&](const char* key) -> std::optional<double> {
      const auto it = r.find(key);
      if (it == r.end() || !it->is_number()) return std::nullopt;
      const double x = it->get<double>();
      return std::isfinite(x) ? std::optional<double>(x) : std::nullopt;
    };
    if (!r["step"].is_number_integer()) continue;
    auto& at = by_step[r["step"].get<int64_t>()];
    const auto replica = r.find("replica");
    const int which = replica != r.end() && replica->is_number_integer() ? replica->get<int>() : 0;
    if (const auto loss = number("loss")) at.replica_loss[which] = *loss;
    if (const auto mean = number("loss_mean_model")) at.mean_model_loss = *mean;
  }
  return by_step;
}

}  // namespace noloco
