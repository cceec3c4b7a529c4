// `noloco report`: a Markdown page comparing runs, with SVG plots of
// validation loss against step and against bytes sent, and weight spread.
#pragma once
#include <string>
#include <vector>

namespace noloco {

// Writes out_dir/report.md and its plots; returns the Markdown.
std::string write_report(const std::vector<std::string>& run_dirs, const std::string& out_dir);

}  // namespace noloco
