// `noloco report`: a Markdown page comparing runs, with SVG plots of
// validation loss against step and against bytes sent, and weight spread.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace noloco {

struct ReportOptions {
  std::optional<double> target_loss;                           // adds time_to_loss_table
  std::optional<std::pair<int64_t, int64_t>> throughput_steps;  // adds throughput_table
};

// What `report target_loss=X throughput=FROM:TO` asks for (0 and "": not
// asked); refused in one line when out of range or malformed.
ReportOptions report_request(double target_loss, const std::string& throughput);

// The comparison table and the tables `options` ask for, without plots.
std::string report_tables(const std::vector<std::string>& run_dirs, const ReportOptions& options);

// Writes out_dir/report.md and its plots, and the tables `options` ask for;
// returns the Markdown.
std::string write_report(const std::vector<std::string>& run_dirs, const std::string& out_dir,
                         const ReportOptions& options = {});

// Per run: the first validation step whose loss (mean over replicas) is at
// most `target`, the wall-clock since training began (and how much of it
// went to evaluating, which is the measurer's cost, not the method's) and the
// training bytes all replicas had sent by then. Runs logged before validation
// records carried `elapsed` show "–" for the times.
std::string time_to_loss_table(const std::vector<std::string>& run_dirs, double target);

// Per run: tokens per second of all its replicas together between steps
// `from` and `to` (from the train records' `tokens` and `elapsed`; a
// pipeline's replicas counted at stage 0), and that as a share of the first
// run's: with the first run `method=none` at the same shape, the share is the
// utilisation a method keeps. Leaving out the first steps (start-up) and the
// last (a final exchange waited for) measures the steady state. Replicas
// without records at both steps in one process life are left out; the
// column says how many were timed.
std::string throughput_table(const std::vector<std::string>& run_dirs, int64_t from, int64_t to);

}  // namespace noloco
