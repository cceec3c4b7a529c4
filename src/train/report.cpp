#include "train/report.h"

#include <algorithm>
#include <filesystem>
#include <functional>
#include <cmath>
#include <map>
#include <optional>
#include <sstream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "train/run_summary.h"
#include "util/files.h"
#include "util/human.h"
#include "util/parse_number.h"
#include "util/svg_plot.h"
#include "util/run_files.h"

namespace noloco {

namespace {

struct Curves {
  std::vector<std::pair<double, double>> loss_by_step, loss_by_bytes, std_by_step;
  // Per validation step, from its last replica to log it: seconds since
  // training began, and how many of them went to evaluating.
  std::vector<std::pair<double, double>> seconds;
  // replica -> step -> (tokens, seconds) since its process began, from train records
  std::map<int, std::map<int64_t, std::pair<double, double>>> progress;
};

// Per validation step: the replicas' mean loss, the weight spread, the
// training bytes all replicas had sent by then, and the wall-clock.
Curves read_curves(const std::string& run_dir) {
  std::map<int64_t, std::vector<double>> val;
  std::map<int64_t, std::pair<double, double>> val_seconds;
  // step -> stage -> (parameters, weight std): a pipeline logs the spread per stage
  std::map<int64_t, std::map<int, std::pair<double, double>>> spread;
  std::map<int, std::map<int64_t, double>> sent;  // worker -> step -> cumulative bytes
  Curves c;
  std::istringstream in(read_file(run_files::in(run_dir, run_files::kMetrics)));
  for (std::string line; std::getline(in, line);) {
    const auto j = nlohmann::json::parse(line, nullptr, false);
    if (j.is_discarded() || !j.contains("split")) continue;
    const auto step = j.value("step", int64_t(0));
    if (j["split"] == "val") {
      if (j.contains("loss")) val[step].push_back(j["loss"].get<double>());
      if (j.contains("elapsed") && j["elapsed"].get<double>() >= val_seconds[step].first)
        val_seconds[step] = {j["elapsed"].get<double>(), j.value("evaluation_seconds", 0.0)};
      if (j.contains("weight_std"))
        spread[step][j.value("stage", 0)] = {j.value("stage_params", 1.0), j["weight_std"].get<double>()};
    } else if (j["split"] == "train") {
      if (j.contains("bytes_sent")) sent[j.value("worker", j.value("replica", 0))][step] = j["bytes_sent"].get<double>();
      if (j.contains("tokens") && j.contains("elapsed") && j.value("stage", 0) == 0)
        c.progress[j.value("replica", 0)][step] = {j["tokens"].get<double>(), j["elapsed"].get<double>()};
    }
  }
  for (auto& [step, losses] : val) {
    double mean = 0;
    for (double l : losses) mean += l;
    mean /= double(losses.size());
    c.loss_by_step.emplace_back(double(step), mean);
    double bytes = 0;
    for (auto& [replica, by_step] : sent) {
      auto it = by_step.upper_bound(step);
      if (it != by_step.begin()) bytes += std::prev(it)->second;
    }
    c.loss_by_bytes.emplace_back(bytes, mean);
    c.seconds.push_back(val_seconds.count(step) ? val_seconds[step] : std::pair{std::nan(""), std::nan("")});
  }
  for (auto& [step, by_stage] : spread) {
    std::vector<std::pair<double, double>> stages;
    for (auto& [stage, n_std] : by_stage) stages.push_back(n_std);
    c.std_by_step.emplace_back(double(step), spread_over_stages(stages));
  }
  return c;
}

// One run as the report shows it: its directory's name, method and curves.
struct Run {
  std::string name;
  Method method;
  Curves curves;
};

Run read_run(const std::string& dir) {
  return {std::filesystem::path(dir).filename().string(), RunSummary::read(dir).method, read_curves(dir)};
}

std::string time_to_loss_table(const std::vector<Run>& runs, double target) {
  std::string t = fmt::format(
      "| run | method | first val step ≤ {0} | wall s to it | of which evaluating | training bytes to it "
      "|\n|---|---|---|---|---|---|\n",
      target);
  for (const auto& [name, method, c] : runs) {
    size_t i = 0;
    while (i < c.loss_by_step.size() && !(c.loss_by_step[i].second <= target)) ++i;
    if (i == c.loss_by_step.size()) {
      t += fmt::format("| {} | {} | not reached | – | – | – |\n", name, choice_name(method));
    } else {
      auto seconds = [](double s) { return std::isnan(s) ? std::string("–") : fmt::format("{:.0f}", s); };
      t += fmt::format("| {} | {} | {:.0f} | {} | {} | {} |\n", name, choice_name(method), c.loss_by_step[i].first,
                       seconds(c.seconds[i].first), seconds(c.seconds[i].second),
                       format_count(c.loss_by_bytes[i].first));
    }
  }
  return t;
}

std::string throughput_table(const std::vector<Run>& runs, int64_t from, int64_t to) {
  std::string t = fmt::format(
      "| run | method | replicas timed | tokens/s, steps {}–{} | of the first run's |\n|---|---|---|---|---|\n", from, to);
  double first = std::nan("");
  for (const auto& [name, method, c] : runs) {
    double tokens_per_second = 0;
    int timed = 0;
    for (const auto& [replica, by_step] : c.progress) {
      const auto a = by_step.find(from), b = by_step.find(to);
      if (a == by_step.end() || b == by_step.end()) continue;
      const double tokens = b->second.first - a->second.first, seconds = b->second.second - a->second.second;
      if (tokens < 0 || seconds <= 0) continue;  // the two records come from different lives of the process
      tokens_per_second += tokens / seconds;
      ++timed;
    }
    if (timed == 0) {
      t += fmt::format("| {} | {} | 0 | – | – |\n", name, choice_name(method));
      continue;
    }
    if (std::isnan(first)) first = tokens_per_second;
    t += fmt::format("| {} | {} | {} | {:.0f} | {:.1f}% |\n", name, choice_name(method), timed, tokens_per_second,
                     100.0 * tokens_per_second / first);
  }
  return t;
}

std::vector<Run> read_runs(const std::vector<std::string>& run_dirs) {
  std::vector<Run> runs;
  for (const auto& dir : run_dirs) runs.push_back(read_run(dir));
  return runs;
}

std::string requested_tables(const std::vector<Run>& runs, const ReportOptions& options) {
  std::string md;
  if (options.target_loss) md += "\n" + time_to_loss_table(runs, *options.target_loss);
  if (options.throughput_steps)
    md += "\n" + throughput_table(runs, options.throughput_steps->first, options.throughput_steps->second);
  return md;
}

// A run's name in every legend, and its colour (the i-th run's): two runs of
// one method are told apart, and identical runs do not hide each other.
PlotSeries run_series(const std::string& dir, Method method, size_t i) {
  PlotSeries s;
  s.name = fmt::format("{} ({})", std::filesystem::path(dir).filename().string(), choice_name(method));
  s.color = series_color(i);
  return s;
}

// Each run's final validation loss against one figure of its summary, a dot
// per run (runs without the figure left out).
std::vector<PlotSeries> final_loss_against(const std::vector<std::string>& run_dirs,
                                           const std::function<std::optional<double>(const RunSummary&)>& figure) {
  std::vector<PlotSeries> series;
  for (size_t i = 0; i < run_dirs.size(); ++i) {
    const auto summary = RunSummary::read(run_dirs[i]);
    const auto x = figure(summary);
    if (!x || !summary.final_val_loss) continue;
    auto s = run_series(run_dirs[i], summary.method, i);
    s.markers = true;
    s.points.emplace_back(*x, *summary.final_val_loss);
    series.push_back(std::move(s));
  }
  return series;
}

// The field's published rates, per inner step, as vertical marks across the
// runs' losses (their losses were measured on other models and data):
// SparseLoCo (arXiv 2508.15706) through a ring all-gather at 8 replicas,
// Covenant-72B's upload once per 30 steps, and a SparseLoCo-sized message
// sent to one partner every 50 steps.
constexpr const char* kRateAnchorsCaption =
    "Each dot is a run. The dashed vertical lines are published rates of other methods, for scale: SparseLoCo "
    "(arXiv 2508.15706) with H=15 and H=100 through a ring all-gather at 8 replicas, Covenant-72B's upload once per "
    "30 steps, and a SparseLoCo-sized message sent to one partner every 50 steps. Their losses were measured on "
    "other models and data, so only where they stand on the x axis means anything here.";

std::vector<PlotSeries> with_rate_anchors(std::vector<PlotSeries> series) {
  if (series.empty()) return series;
  double low = INFINITY, high = -INFINITY;
  for (const auto& s : series)
    for (const auto& [x, y] : s.points) low = std::min(low, y), high = std::max(high, y);
  struct Anchor {
    const char* name;
    double rate;
    const char* color;
  };
  const Anchor anchors[] = {{"SparseLoCo H=15, 8-replica ring (0.102)", 0.102, "#b0b0b0"},
                            {"SparseLoCo H=100, 8-replica ring (0.015)", 0.015, "#808080"},
                            {"Covenant-72B, every 30 steps (0.0073)", 0.0073, "#c9a227"},
                            {"SparseLoCo message to one partner, H=50 (0.0044)", 0.0044, "#505050"}};
  for (const auto& a : anchors) series.push_back(PlotSeries{a.name, a.color, /*dashed=*/true, {{a.rate, low}, {a.rate, high}}});
  return series;
}

}  // namespace

std::string report_tables(const std::vector<std::string>& run_dirs, const ReportOptions& options) {
  return comparison_table(run_dirs) + requested_tables(read_runs(run_dirs), options);
}

std::string throughput_table(const std::vector<std::string>& run_dirs, int64_t from, int64_t to) {
  return throughput_table(read_runs(run_dirs), from, to);
}

std::string time_to_loss_table(const std::vector<std::string>& run_dirs, double target) {
  return time_to_loss_table(read_runs(run_dirs), target);
}

std::string write_report(const std::vector<std::string>& run_dirs, const std::string& out_dir,
                         const ReportOptions& options) {
  std::filesystem::create_directories(out_dir);
  std::vector<PlotSeries> by_step, by_bytes, spread;
  const auto runs = read_runs(run_dirs);
  for (size_t i = 0; i < runs.size(); ++i) {
    const auto& curves = runs[i].curves;
    auto s = run_series(run_dirs[i], runs[i].method, i);
    s.points = curves.loss_by_step;
    by_step.push_back(s);
    s.points = curves.loss_by_bytes;
    by_bytes.push_back(s);
    s.points = curves.std_by_step;
    if (!s.points.empty()) spread.push_back(s);
  }
  write_file_atomic(out_dir + "/val_loss_vs_step.svg",
                    line_chart_svg(by_step, {"Validation loss", "inner step", "validation loss (mean over replicas)"}));
  write_file_atomic(out_dir + "/val_loss_vs_bytes.svg",
                    line_chart_svg(by_bytes, {"Validation loss against communication", "training bytes sent, all replicas",
                                              "validation loss (mean over replicas)", /*log_y=*/false, /*log_x=*/true,
                                              /*x_bytes=*/true}));
  std::string md = "# noloco report\n\n" + comparison_table(run_dirs) +
                   "\nLoss and perplexity are the mean over replicas of each replica's own model; the mean-model "
                   "column evaluates the average of the replicas' weights. Bytes count training traffic only.\n\n"
                   "![validation loss against step](val_loss_vs_step.svg)\n\n"
                   "![validation loss against bytes](val_loss_vs_bytes.svg)\n";
  md += requested_tables(runs, options);
  // The plots only some runs have data for, each with its line in the report.
  const auto add_plot = [&](const std::string& file, const std::vector<PlotSeries>& series, const PlotOptions& plot,
                            const std::string& alt, const std::string& caption = "") {
    if (series.empty()) return;
    write_file_atomic(out_dir + "/" + file, line_chart_svg(series, plot));
    md += fmt::format("\n![{}]({})\n", alt, file);
    if (!caption.empty()) md += "\n" + caption + "\n";
  };
  add_plot("val_loss_vs_activation_bytes.svg",
           final_loss_against(run_dirs,
                              [](const RunSummary& r) -> std::optional<double> {
                                if (r.stages > 1) return r.activation_bytes_per_step;
                                return std::nullopt;
                              }),
           {"Pipelines: validation loss against activation traffic", "activation bytes per step (coded, both directions)",
            "final validation loss (mean over replicas)", /*log_y=*/false, /*log_x=*/true, /*x_bytes=*/true},
           "final validation loss against activation bytes per step");
  add_plot("val_loss_vs_outer_bits.svg",
           with_rate_anchors(final_loss_against(run_dirs,
                                                [](const RunSummary& r) -> std::optional<double> {
                                                  if (r.method == Method::ddp) return std::nullopt;
                                                  return r.bits_per_param_per_inner_step;
                                                })),
           {"Validation loss against the rate of outer messages",
            "bits per parameter per inner step (all a replica sent for training)",
            "final validation loss (mean over replicas)", /*log_y=*/false, /*log_x=*/true, /*x_bytes=*/false,
            /*min_relative_y_span=*/0.02},
           "final validation loss against bits per parameter per inner step", kRateAnchorsCaption);
  // A log axis for spreads that span decades; where no replicas ever differ
  // (DiLoCo, DDP) it would be an empty frame, so a linear one shows the zeros.
  bool spread_positive = false;
  for (const auto& s : spread)
    for (const auto& [step, std] : s.points) spread_positive = spread_positive || std > 0;
  add_plot("weight_std_vs_step.svg", spread,
           {"Spread of weights across replicas", "inner step", "standard deviation of weights", spread_positive},
           "weight standard deviation against step");
  write_file_atomic(out_dir + "/report.md", md);
  return md;
}

ReportOptions report_request(double target_loss, const std::string& throughput) {
  if (target_loss < 0) throw std::invalid_argument("report needs target_loss >= 0");
  ReportOptions report;
  if (target_loss > 0) report.target_loss = target_loss;
  if (throughput.empty()) return report;
  const auto colon = throughput.find(':');
  const auto bad = std::invalid_argument(
      fmt::format("report throughput wants two steps FROM:TO with 0 <= FROM < TO, got '{}'", throughput));
  if (colon == std::string::npos) throw bad;
  int64_t from = -1, to = -1;
  try {
    from = parse_integer("throughput", throughput.substr(0, colon));
    to = parse_integer("throughput", throughput.substr(colon + 1));
  } catch (const std::invalid_argument&) {
    throw bad;
  }
  if (from < 0 || to <= from) throw bad;
  report.throughput_steps = std::pair{from, to};
  return report;
}

}  // namespace noloco
