// The run-level summary.json of a multi-replica run, from the replicas' own
// summaries and how each worker ended; and the comparison table of runs.
#pragma once
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "comm/launcher.h"

namespace noloco {

nlohmann::json summarize_run(const std::string& out, const TrainConfig& config, const std::vector<WorkerExit>& exits,
                             double seconds);

// The spread of weights across replicas over the whole model, from each
// stage's (parameter count, spread): sqrt(Σ n·σ² / Σ n). NaN if any spread
// is NaN or there are no parameters.
double spread_over_stages(const std::vector<std::pair<double, double>>& stages);

// Markdown table comparing runs (each a run directory with summary.json).
std::string comparison_table(const std::vector<std::string>& run_dirs);

}  // namespace noloco
