// The run-level summary.json of a multi-replica run, from the replicas' own
// summaries and how each worker ended; and the comparison table of runs.
#pragma once
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "comm/launcher.h"

namespace noloco {

nlohmann::json summarize_run(const std::string& out, const TrainConfig& config, const std::vector<WorkerExit>& exits,
                             double seconds);

// Markdown table comparing runs (each a run directory with summary.json).
std::string comparison_table(const std::vector<std::string>& run_dirs);

}  // namespace noloco
