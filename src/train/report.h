// `noloco report`: a Markdown page comparing runs, with SVG plots of
// validation loss against step and against bytes sent, and weight spread.
#pragma once
#include <optional>
#include <string>
#include <vector>

namespace noloco {

// Writes out_dir/report.md and its plots (with target_loss, also the
// time-to-loss table); returns the Markdown.
std::string write_report(const std::vector<std::string>& run_dirs, const std::string& out_dir,
                         std::optional<double> target_loss = std::nullopt);

// Per run: the first validation step whose loss (mean over replicas) is at
// most `target`, the wall-clock since training began (and how much of it
// went to evaluating, which is the measurer's cost, not the method's) and the
// training bytes all replicas had sent by then. Runs logged before validation
// records carried `elapsed` show "–" for the times.
std::string time_to_loss_table(const std::vector<std::string>& run_dirs, double target);

}  // namespace noloco
