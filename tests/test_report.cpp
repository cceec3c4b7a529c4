#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <tuple>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "test_util.h"
#include "train/model_choice.h"
#include "train/report.h"
#include "train/run_summary.h"
#include "util/files.h"
#include "util/human.h"
#include "util/svg_plot.h"

using namespace noloco;
using noloco::testing::TempDir;

namespace {

// Cells of the table row whose first cell is `run`.
std::vector<std::string> row_of(const std::string& markdown, const std::string& run) {
  std::istringstream in(markdown);
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("| " + run + " |", 0) != 0) continue;
    std::vector<std::string> cells;
    std::istringstream row(line.substr(1));
    for (std::string cell; std::getline(row, cell, '|');) {
      cell.erase(0, cell.find_first_not_of(' '));
      cell.erase(cell.find_last_not_of(' ') + 1);
      cells.push_back(cell);
    }
    return cells;
  }
  return {};
}

}  // namespace

TEST(Report, TableMatchesSummariesAndPlotsAreWritten) {
  TempDir dir;
  noloco::testing::write_text(dir / "c.txt", noloco::testing::shakespeare(20000));
  const std::string common = " hidden=32 layers=2 heads=2 intermediate=64 context=32 batch=2 steps=8 outer_interval=2"
                             " eval_interval=4 eval_batches=1 log_interval=2 sample_tokens=0 replicas=2 data=" +
                             dir / "c.txt";
  for (auto method : {"noloco", "diloco"}) {
    auto r = noloco::testing::run_cli(fmt::format("train configs/shakespeare.yaml method={} out={}{}", method,
                                                  dir / method, common));
    ASSERT_EQ(r.exit_code, 0) << r.output;
  }
  auto r = noloco::testing::run_cli(
      fmt::format("train configs/shakespeare.yaml method=noloco wire_dtype=int8 out={}{}", dir / "noloco_int8", common));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto md = write_report({dir / "noloco", dir / "diloco", dir / "noloco_int8"}, dir / "report",
                               {100.0, std::pair{int64_t(2), int64_t(8)}});
  EXPECT_EQ(read_file(dir / "report/report.md"), md);
  // Every loss is below 100: each run reaches it at its first validation (step 4),
  // timed by the last of its replicas to log that validation.
  for (auto method : {"noloco", "diloco"}) {
    double seconds = -1, evaluating = -1;
    std::istringstream metrics(read_file(dir / method + "/metrics.jsonl"));
    for (std::string line; std::getline(metrics, line);) {
      const auto j = nlohmann::json::parse(line);
      if (j.value("split", "") == "val" && j["step"] == 4 && j["elapsed"].get<double>() >= seconds) {
        seconds = j["elapsed"].get<double>();
        evaluating = j["evaluation_seconds"].get<double>();
      }
    }
    EXPECT_GT(evaluating, 0) << method;
    EXPECT_LT(evaluating, seconds) << method;
    ASSERT_GE(seconds, 0) << method;
    const auto cells = row_of(md, method);
    ASSERT_EQ(cells.size(), 15u) << md;  // the comparison row; the time row comes after it
    const auto timed = row_of(time_to_loss_table({dir / method}, 100.0), method);
    ASSERT_EQ(timed.size(), 6u);
    EXPECT_EQ(timed[2], "4");
    EXPECT_EQ(timed[3], fmt::format("{:.0f}", seconds));
    EXPECT_EQ(timed[4], fmt::format("{:.0f}", evaluating));
    EXPECT_NE(md.find("| " + timed[2] + " | " + timed[3] + " |"), std::string::npos) << md;
  }
  EXPECT_EQ(row_of(time_to_loss_table({dir / "noloco"}, 0.01), "noloco")[2], "not reached");
  // Throughput between steps 2 and 8: each replica's tokens (8 steps of batch 2
  // x context 32 by step 8) over its own seconds, summed over the replicas.
  std::map<std::string, double> tokens_per_second;
  for (auto method : {"noloco", "diloco"}) {
    std::map<int, std::map<int64_t, std::pair<double, double>>> at;
    std::istringstream metrics(read_file(dir / method + "/metrics.jsonl"));
    for (std::string line; std::getline(metrics, line);) {
      const auto j = nlohmann::json::parse(line);
      if (j.value("split", "") == "train")
        at[j["replica"].get<int>()][j["step"].get<int64_t>()] = {j["tokens"].get<double>(), j["elapsed"].get<double>()};
    }
    ASSERT_EQ(at.size(), 2u);
    for (auto& [replica, by_step] : at) {
      EXPECT_EQ(by_step.at(8).first, 8 * 2 * 32) << method;
      tokens_per_second[method] += (by_step.at(8).first - by_step.at(2).first) / (by_step.at(8).second - by_step.at(2).second);
    }
    const auto cells = row_of(md.substr(md.find("tokens/s, steps 2–8")), method);
    ASSERT_EQ(cells.size(), 5u) << md;
    EXPECT_EQ(cells[2], "2");
    EXPECT_EQ(cells[3], fmt::format("{:.0f}", tokens_per_second[method]));
  }
  const auto shares = throughput_table({dir / "diloco", dir / "noloco"}, 2, 8);
  EXPECT_EQ(row_of(shares, "diloco")[4], "100.0%");
  EXPECT_EQ(row_of(shares, "noloco")[4], fmt::format("{:.1f}%", 100 * tokens_per_second["noloco"] / tokens_per_second["diloco"]));
  EXPECT_EQ(row_of(throughput_table({dir / "noloco"}, 3, 8), "noloco")[3], "–") << "no records at step 3";
  for (auto method : {"noloco", "diloco"}) {
    const auto summary = read_json(dir / method + "/summary.json");
    const auto cells = row_of(md, method);
    ASSERT_GE(cells.size(), 15u) << md;
    EXPECT_EQ(cells[1], method);
    EXPECT_EQ(cells[2], "2");
    EXPECT_EQ(cells[3], fmt::format("{:.4f}", summary["final_val_loss"].get<double>()));
    EXPECT_EQ(cells[5], fmt::format("{:.4f}", summary["final_val_loss_mean_model"].get<double>()));
    EXPECT_EQ(cells[6], fmt::format("{:.4f} ({})", summary["final_val_loss_best_replica"].get<double>(),
                                     summary["best_replica"].get<int>()));
    EXPECT_EQ(cells[7], summary["handed_over"].get<std::string>());
    EXPECT_EQ(cells[10], fmt::format("{:.3g}", summary["bits_per_param_per_inner_step"].get<double>()));
    EXPECT_EQ(cells[13], std::to_string(summary["collectives"].get<int64_t>()));
  }
  EXPECT_EQ(row_of(md, "noloco")[13], "0");
  // Each run its own colour and legend name, also two runs of one method (issue 67 item 7).
  const std::vector<std::string> names = {"noloco (noloco)", "diloco (diloco)", "noloco_int8 (noloco)"};
  for (auto plot : {"val_loss_vs_step.svg", "val_loss_vs_bytes.svg", "val_loss_vs_outer_bits.svg"}) {
    const auto svg = read_file(dir / "report/" + plot);
    for (size_t i = 0; i < names.size(); ++i) {
      const auto legend = svg.find(">" + names[i] + "<");
      ASSERT_NE(legend, std::string::npos) << plot << " names " << names[i] << "\n" << svg;
      // The legend draws a run as the plot does: a dot a run against outer bits, else a line.
      const std::string mark = plot == std::string("val_loss_vs_outer_bits.svg") ? "fill=\"" : "stroke=\"";
      EXPECT_NE(svg.rfind(mark + series_color(i) + "\"", legend), std::string::npos) << plot << " " << names[i];
    }
  }
  EXPECT_NE(read_file(dir / "report/val_loss_vs_step.svg").find("<polyline"), std::string::npos);
  EXPECT_NE(read_file(dir / "report/val_loss_vs_bytes.svg").find("training bytes sent"), std::string::npos);
  // Final loss against bits per parameter per inner step: a dot a run, the field's rates marked.
  EXPECT_NE(md.find("(val_loss_vs_outer_bits.svg)"), std::string::npos) << md;
  const auto bits = read_file(dir / "report/val_loss_vs_outer_bits.svg");
  size_t dots = 0;
  for (size_t at = bits.find("<circle"); at != std::string::npos; at = bits.find("<circle", at + 1)) ++dots;
  EXPECT_EQ(dots, 6u) << "a dot a run, and its dot in the legend\n" << bits;
  EXPECT_NE(bits.find("bits per parameter per inner step"), std::string::npos);
  EXPECT_NE(bits.find("Covenant-72B, every 30 steps (0.0073)"), std::string::npos);
  EXPECT_NE(bits.find("SparseLoCo H=100, 8-replica ring (0.015)"), std::string::npos);
  // DiLoCo's replicas never differ (nor do NoLoCo's two in fp32, a group of
  // the whole run): on the spread's log axis they are drawn on the line
  // labelled 0 below it; int8 messages leave the NoLoCo pair apart.
  const auto spread = read_file(dir / "report/weight_std_vs_step.svg");
  EXPECT_NE(spread.find("(log scale)"), std::string::npos) << spread;
  EXPECT_NE(spread.find(">diloco (diloco)<"), std::string::npos) << spread;
  EXPECT_NE(spread.find(" text-anchor=\"end\">0<"), std::string::npos) << spread;
  EXPECT_EQ(spread.find("not drawn"), std::string::npos) << spread;
  EXPECT_NE(spread.find(">noloco_int8 (noloco)<"), std::string::npos) << spread;
  EXPECT_NE(spread.find("<polyline"), std::string::npos) << spread;
}

// Issue 67 item 7: a spread that is 0 everywhere had a log axis and an empty
// frame; ticks over a narrow range read "1.914" four times; a lone point was
// no line and so drew nothing.
TEST(SvgPlot, ZerosLoneDotsAndNarrowRangesAreDrawnAndLabelled) {
  const PlotSeries flat{"equal replicas", series_color(0), false, {{0, 0.0}, {10, 0.0}}};
  const auto on_log = line_chart_svg({flat}, {"spread", "step", "std", /*log_y=*/true});
  EXPECT_NE(on_log.find(">equal replicas (not drawn: nothing above 0 on the log axis)<"), std::string::npos) << on_log;
  EXPECT_EQ(on_log.find("<polyline"), std::string::npos);
  const auto linear = line_chart_svg({flat}, {"spread", "step", "std"});
  EXPECT_NE(linear.find("<polyline"), std::string::npos);
  EXPECT_NE(linear.find(">equal replicas<"), std::string::npos);

  const PlotSeries narrow{"narrow", series_color(1), false, {{1, 1.91401}, {2, 1.91405}, {3, 1.91409}}};
  const auto svg = line_chart_svg({narrow}, {"loss", "step", "loss"});
  std::vector<std::string> y_labels;
  for (size_t at = svg.find("text-anchor=\"end\">"); at != std::string::npos;
       at = svg.find("text-anchor=\"end\">", at + 1)) {
    const size_t from = at + std::string("text-anchor=\"end\">").size();
    y_labels.push_back(svg.substr(from, svg.find('<', from) - from));
  }
  ASSERT_GE(y_labels.size(), 3u) << svg;
  EXPECT_EQ(std::set<std::string>(y_labels.begin(), y_labels.end()).size(), y_labels.size()) << svg;
  EXPECT_EQ(svg.find(">1.914<"), std::string::npos) << "four digits do not tell these ticks apart\n" << svg;

  const PlotSeries lone{"one run", series_color(2), false, {{0.01, 2.0}}};
  const auto dot = line_chart_svg({lone}, {"loss against bits", "bits", "loss", false, /*log_x=*/true});
  EXPECT_NE(dot.find("<circle"), std::string::npos) << dot;
  EXPECT_NE(dot.find("fill=\"" + series_color(2) + "\""), std::string::npos) << dot;
  EXPECT_NE(series_color(0), series_color(1));
}

namespace {

// The points of the first polyline drawn in `color`.
std::vector<std::pair<double, double>> polyline_of(const std::string& svg, const std::string& color) {
  std::vector<std::pair<double, double>> out;
  const auto at = svg.find("<polyline fill=\"none\" stroke=\"" + color + "\"");
  if (at == std::string::npos) return out;
  const auto from = svg.find("points=\"", at) + 8;
  std::istringstream points(svg.substr(from, svg.find('"', from) - from));
  double x = 0, y = 0;
  char comma = 0;
  while (points >> x >> comma >> y) out.emplace_back(x, y);
  return out;
}

// The labels drawn with `anchor`, as (x, y, text).
std::vector<std::tuple<double, double, std::string>> labels_of(const std::string& svg, const std::string& anchor) {
  std::vector<std::tuple<double, double, std::string>> out;
  const std::string tail = "\" text-anchor=\"" + anchor + "\">";
  for (size_t at = svg.find(tail); at != std::string::npos; at = svg.find(tail, at + 1)) {
    const auto open = svg.rfind("<text x=\"", at);
    const double x = std::stod(svg.substr(open + 9));
    const double y = std::stod(svg.substr(svg.find("y=\"", open) + 3));
    const auto from = at + tail.size();
    out.emplace_back(x, y, svg.substr(from, svg.find('<', from) - from));
  }
  return out;
}

// The labels turned upright (x, y, text), in order.
std::vector<std::tuple<double, double, std::string>> upright_labels_of(const std::string& svg) {
  std::vector<std::tuple<double, double, std::string>> out;
  const std::string marker = "transform=\"rotate(-90 ";
  for (size_t at = svg.find(marker); at != std::string::npos; at = svg.find(marker, at + 1)) {
    const auto open = svg.rfind("<text x=\"", at);
    const double x = std::stod(svg.substr(open + 9));
    const double y = std::stod(svg.substr(svg.find("y=\"", open) + 3));
    const auto from = svg.find('>', at) + 1;
    out.emplace_back(x, y, svg.substr(from, svg.find('<', from) - from));
  }
  return out;
}

size_t count_of(const std::string& text, const std::string& what) {
  size_t n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

}  // namespace

// Issue 84: DiLoCo's zero spreads vanished from the log axis (its line
// joined 250 to 750, as if it never synchronised); a column of labels mixed
// 0.003162 with 5.6e-04 and read "-0"; close x ticks ran together as
// "0.480.64"; wide y labels ran into the axis title; runs drawn as dots had
// lines in the legend.
TEST(SvgPlot, ZerosOnALogAxisSitOnALineOfTheirOwnAndTheLabelsStayApartAndAlike) {
  const PlotSeries diloco{"diloco", series_color(0), false, {{250, 3e-3}, {500, 0.0}, {750, 2e-3}, {1000, 0.0}}};
  const auto log = line_chart_svg({diloco}, {"spread", "step", "std", /*log_y=*/true});
  const auto points = polyline_of(log, series_color(0));
  ASSERT_EQ(points.size(), 4u) << log;
  EXPECT_EQ(points[1].second, points[3].second) << log;
  EXPECT_GT(points[1].second, std::max(points[0].second, points[2].second)) << "zero is below every value\n" << log;
  bool zero_labelled = false;
  for (const auto& [x, y, text] : labels_of(log, "end")) zero_labelled |= text == "0" && std::abs(y - 4 - points[1].second) < 0.2;
  EXPECT_TRUE(zero_labelled) << log;

  const PlotSeries small{"small", series_color(1), false, {{0, 4e-4}, {1, 1.4e-3}}};  // ticks from 5e-4 to 1.25e-3
  const auto linear = line_chart_svg({small}, {"spread", "step", "std"});
  const auto y_labels = labels_of(linear, "end");
  ASSERT_GE(y_labels.size(), 3u) << linear;
  for (const auto& [x, y, text] : y_labels) {
    EXPECT_NE(text.find('e'), std::string::npos) << "one form for all: " << text << "\n" << linear;
    EXPECT_GE(x - 7.2 * double(text.size()), 24.0) << "the label runs into the axis title: " << text;
  }
  const PlotSeries around_zero{"around", series_color(2), false, {{0, -1.0}, {1, 1.0}}};
  const auto crossing = line_chart_svg({around_zero}, {"t", "x", "y"});
  EXPECT_EQ(crossing.find(">-0<"), std::string::npos) << crossing;
  EXPECT_EQ(crossing.find(">-0.0<"), std::string::npos) << crossing;
  EXPECT_NE(crossing.find(">0.0<"), std::string::npos) << crossing;
  EXPECT_NE(crossing.find(">-0.5<"), std::string::npos) << "evenly spaced ticks carry the same decimals\n" << crossing;
  // The demo's 2000 steps: whole steps, not "1500.00000" (a %g exponent's decimals).
  const PlotSeries steps{"steps", series_color(3), false, {{250, 1.0}, {2000, 2.0}}};
  const auto by_step = line_chart_svg({steps}, {"t", "inner step", "y"});
  std::set<std::string> step_texts;
  for (const auto& [x, y, text] : labels_of(by_step, "middle"))
    if (y == 376.0) step_texts.insert(text);
  EXPECT_EQ(step_texts, (std::set<std::string>{"500", "1000", "1500", "2000"})) << by_step;

  // Runs as dots at x values close together on a log axis (the outer-bits plot).
  std::vector<PlotSeries> runs;
  for (const double bits : {0.3, 0.48, 0.64, 0.7}) {
    PlotSeries run{fmt::format("run at {}", bits), series_color(runs.size()), false, {{bits, 2.0 - bits}}};
    run.markers = true;
    runs.push_back(run);
  }
  PlotSeries anchor{"reference", "#808080", /*dashed=*/true, {{0.1, 1.2}, {0.1, 1.8}}};
  runs.push_back(anchor);
  const auto dots = line_chart_svg(runs, {"loss against bits", "bits", "loss", false, /*log_x=*/true});
  // Issue 103: staggered over two rows they read as one jumble; now they stand
  // upright on one line, each clear of the next, and the axis title below them.
  for (const auto& [x, y, text] : labels_of(dots, "middle"))
    EXPECT_NE(y, 376.0) << "a flat x label beside upright ones: " << text << "\n" << dots;
  const auto upright = upright_labels_of(dots);
  std::set<std::string> x_texts;
  double lowest = 0;
  for (size_t i = 0; i < upright.size(); ++i) {
    const auto& [x, y, text] = upright[i];
    x_texts.insert(text);
    EXPECT_EQ(y, std::get<1>(upright[0])) << "one line: " << text;
    if (i > 0) EXPECT_GE(x - std::get<0>(upright[i - 1]), 13.0) << text << " touches the label before it\n" << dots;
    lowest = std::max(lowest, y + 7.2 * double(text.size()));
  }
  EXPECT_EQ(x_texts, (std::set<std::string>{"0.1", "0.3", "0.48", "0.64", "0.7"})) << "every rate is labelled\n" << dots;
  const auto title = dots.find(">bits (log scale)<");
  ASSERT_NE(title, std::string::npos) << dots;
  EXPECT_GT(std::stod(dots.substr(dots.rfind("y=\"", title) + 3)), lowest + 8) << "the axis title under the labels";
  for (size_t i = 0; i + 1 < runs.size(); ++i) {
    const auto& color = runs[i].color;
    EXPECT_EQ(count_of(dots, "stroke=\"" + color + "\""), 0u)
        << "a run drawn as a dot has no line, in the plot or the legend: " << runs[i].name;
    EXPECT_EQ(count_of(dots, "fill=\"" + color + "\""), 2u) << "its dot, and its dot in the legend: " << runs[i].name;
  }
  EXPECT_EQ(count_of(dots, "stroke=\"#808080\" stroke-width=\"2\" stroke-dasharray"), 2u)
      << "the reference line, and its line in the legend\n" << dots;
}

// Issue 103: runs 0.15% apart filled the loss-against-bits plot from top to
// bottom; given a least span, their dots sit close, as close as they are.
TEST(SvgPlot, AMinimumRelativeSpanKeepsRunsThatAreCloseClose) {
  std::vector<PlotSeries> runs;
  for (const auto& [bits, loss] : {std::pair{0.1, 2.012}, std::pair{1.0, 2.015}}) {
    PlotSeries run{fmt::format("run at {}", bits), series_color(runs.size()), false, {{bits, loss}}};
    run.markers = true;
    runs.push_back(run);
  }
  PlotOptions options{"loss against bits", "bits", "loss", false, /*log_x=*/true};
  const auto dot_height = [&](const std::string& svg, const std::string& color) {
    const auto at = svg.find("fill=\"" + color + "\"");
    const auto cy = svg.rfind("cy=\"", at);
    return std::stod(svg.substr(cy + 4));
  };
  const auto filled = line_chart_svg(runs, options);
  const double apart = std::abs(dot_height(filled, runs[0].color) - dot_height(filled, runs[1].color));
  options.min_relative_y_span = 0.02;
  const auto spanned = line_chart_svg(runs, options);
  const double close = std::abs(dot_height(spanned, runs[0].color) - dot_height(spanned, runs[1].color));
  EXPECT_GT(apart, 200) << "without a least span the two fill the frame\n" << filled;
  EXPECT_LT(close, 0.1 * apart) << "3e-3 of 2.0 is 7.5% of a 2% span\n" << spanned;
  EXPECT_GT(close, 0.05 * apart) << spanned;
}

// Issue 50 item 10: the demo's own run names were clipped at the right edge
// of the plots, and byte axes read 5.6e+07 where a person expects 56 MB.
TEST(Report, LegendsHoldTheirNamesAndByteAxesReadInBytes) {
  const std::string name = "demo-20261126-040908-noloco (noloco, 8 replicas, compression=sparse)";
  const PlotSeries series{name, "#2ca02c", false, {{5.6e7, 2.0}, {1.11e9, 1.8}}};
  PlotOptions options{"loss against bytes", "training bytes sent", "validation loss", false, true};
  options.x_bytes = true;
  const auto svg = line_chart_svg({series}, options);
  const auto width_at = svg.find("width=\"") + 7;
  const double width = std::stod(svg.substr(width_at, svg.find('"', width_at) - width_at));
  const auto legend_at = svg.rfind("<text x=\"") + 9;
  const double legend_x = std::stod(svg.substr(legend_at, svg.find('"', legend_at) - legend_at));
  EXPECT_GE(width, legend_x + 7.0 * double(name.size())) << "the legend's name runs past the picture";
  EXPECT_NE(svg.find(">56 MB<"), std::string::npos) << svg;
  EXPECT_NE(svg.find(">1.11 GB<"), std::string::npos) << svg;
  EXPECT_EQ(svg.find("e+0"), std::string::npos) << svg;
  EXPECT_EQ(format_bytes(512), "512 B");
  EXPECT_EQ(format_bytes(999.4), "999 B");
  EXPECT_EQ(format_bytes(999.6), "1 kB");
  EXPECT_EQ(format_bytes(1.11e9), "1.11 GB");
}

// Issue 50 item 2: the run's summary shows its health at a glance: the
// worst replica's share of outer steps with a partner, the longest stretch
// alone, the hand-overs served and abandoned, and which replicas were alone
// at more than a tenth of their outer steps.
TEST(RunSummary, HealthFiguresCombineOverTheReplicasAndNameTheLonelyOnes) {
  TempDir dir;
  const auto worker = [&](int rank, double paired, double alone, double served, double abandoned) {
    WorkerSummary w;
    w.method = Method::noloco;
    w.replicas = 4;
    w.steps = 100;
    w.paired_fraction = paired;
    w.longest_alone_outer_steps = alone;
    w.handovers_served = served;
    w.handovers_abandoned = abandoned;
    write_json_atomic(fmt::format("{}/summary_r{}.json", dir.path(), rank), w.to_json());
    return WorkerExit{rank};
  };
  // Replica 3 missed one exchange of four (a partner that left): alone at 25%, but once.
  const std::vector<WorkerExit> exits{worker(0, 1.0, 0, 1, 0), worker(1, 0.06, 469, 0, 2), worker(2, 0.95, 2, 0, 0),
                                      worker(3, 0.75, 1, 0, 0)};
  const auto run = summarize_run(dir.path(), Method::noloco, 4, 1, "", 1, exits, 10.0);
  EXPECT_EQ(run.paired_fraction_worst, 0.06);
  EXPECT_EQ(run.longest_alone_outer_steps, 469.0);
  EXPECT_EQ(run.handovers_served, 1.0);
  EXPECT_EQ(run.handovers_abandoned, 2.0);
  EXPECT_EQ(run.replicas_mostly_alone, std::vector<int>{1});
  const auto back = RunSummary::from_json(run.to_json());
  EXPECT_EQ(back.paired_fraction_worst, run.paired_fraction_worst);
  EXPECT_EQ(back.replicas_mostly_alone, run.replicas_mostly_alone);
  EXPECT_EQ(back.handovers_abandoned, run.handovers_abandoned);
}

// Issue 50 item 8: a joiner killed after it joined is listed under `joined`
// (it was a member) as well as under the failed.
TEST(RunSummary, AJoinerThatDiedAfterJoiningIsListedAsJoinedAndFailed) {
  TempDir dir;
  WorkerSummary w;
  w.method = Method::noloco;
  w.replicas = 2;
  write_json_atomic(dir / "summary_r0.json", w.to_json());
  write_json_atomic(dir / "summary_r1.json", w.to_json());
  WorkerExit joiner{2};
  joiner.joined = true;
  joiner.signal = 9;
  joiner.exit_code = -1;
  const auto run = summarize_run(dir.path(), Method::noloco, 2, 1, "", 1, {WorkerExit{0}, WorkerExit{1}, joiner}, 10.0);
  ASSERT_EQ(run.joined.size(), 1u);
  EXPECT_EQ(run.joined[0].replica, 2);
  ASSERT_EQ(run.failed.size(), 1u);
  EXPECT_EQ(run.failed[0].replica, 2);
  EXPECT_EQ(run.finished, (std::vector<int>{0, 1}));
}

// Issue 83 item 8: where every replica left (torchrun's rank 0 among them,
// which writes the summary), the run's figures are still what they trained
// and last evaluated, not zeros and null; a leaver's tokens count beside a finisher's.
TEST(RunSummary, ReplicasThatLeftStillCountWhatTheyTrainedAndEvaluated) {
  TempDir dir;
  const auto worker = [&](int rank, std::optional<int64_t> left_at, double loss) {
    WorkerSummary w;
    w.method = Method::noloco;
    w.replicas = 3;
    w.steps = left_at.value_or(100);
    w.tokens = 1000 * w.steps;
    w.params = 4096;
    w.final_val_loss = w.final_train_loss = loss;
    w.left_at_step = left_at;
    write_json_atomic(fmt::format("{}/summary_r{}.json", dir.path(), rank), w.to_json());
    return WorkerExit{rank};
  };
  const auto all_left = summarize_run(dir.path(), Method::noloco, 2, 1, "", 1,
                                      {worker(0, 40, 2.0), worker(1, 60, 3.0)}, 10.0);
  EXPECT_TRUE(all_left.finished.empty());
  EXPECT_EQ(all_left.left.size(), 2u);
  EXPECT_EQ(all_left.tokens, 100000);
  EXPECT_EQ(all_left.steps, 60) << "the furthest a replica trained";
  EXPECT_EQ(all_left.params, 4096);
  ASSERT_TRUE(all_left.final_val_loss);
  EXPECT_DOUBLE_EQ(*all_left.final_val_loss, 2.5);
  EXPECT_TRUE(all_left.final_val_loss_replicas.empty()) << "no replica finished";

  const auto one_left = summarize_run(dir.path(), Method::noloco, 3, 1, "", 1,
                                      {worker(0, std::nullopt, 1.5), worker(1, 30, 4.0), worker(2, std::nullopt, 2.5)},
                                      10.0);
  EXPECT_EQ(one_left.finished, (std::vector<int>{0, 2}));
  EXPECT_EQ(one_left.tokens, 230000);
  EXPECT_EQ(one_left.steps, 100);
  ASSERT_TRUE(one_left.final_val_loss);
  EXPECT_DOUBLE_EQ(*one_left.final_val_loss, 2.0) << "the finished replicas' mean";
}

// Issue 84: an evaluation's sample is one line of the log, cut between characters.
TEST(HumanText, OneLineJoinsTheLinesOfASampleAndCutsBetweenCharacters) {
  EXPECT_EQ(one_line("ROMEO:\nBut soft!\n\nWhat light\r\n", 100), "ROMEO: | But soft! | What light | ");
  EXPECT_EQ(one_line("\nshort", 100), "short");
  EXPECT_EQ(one_line("abcdef", 4), "abcd");
  EXPECT_EQ(one_line("ab\xc3\xa9z", 3), "ab") << "a cut inside a two-byte character drops it";
  EXPECT_EQ(one_line("ab\xc3\xa9z", 4), "ab\xc3\xa9");
  EXPECT_EQ(one_line("a\xe2\x82\xac!", 3), "a") << "and inside a three-byte one";
}

// Issue 101: a run hands over the mean of its replicas only where its own
// validation found the mean at least as good as its best replica.
TEST(ModelChoice, TheMeanOnlyWhereItValidatedAtLeastAsWellAsTheBestReplica) {
  // NoLoCo with fp32 messages: the mean beats every replica.
  auto choice = choose_model({{{0, 1.3617}, {1, 1.3620}, {2, 1.3601}}, 1.3561});
  EXPECT_FALSE(choice.replica);
  EXPECT_NE(choice.why.find("1.3561"), std::string::npos) << choice.why;
  EXPECT_NE(choice.why.find("(2) 1.3601"), std::string::npos) << choice.why;
  // Equal counts as good, to float rounding (DiLoCo's identical replicas).
  EXPECT_FALSE(choose_model({{{0, 1.5}, {1, 1.5}}, 1.5}).replica);
  EXPECT_FALSE(choose_model({{{0, 2.1255}, {1, 2.1255}}, 2.1255 + 2e-7}).replica);
  EXPECT_TRUE(choose_model({{{0, 2.0905}, {1, 2.0933}}, 2.0906}).replica) << "5e-5 worse is worse";
  // topk: replicas drifted apart, their mean is worse than each.
  choice = choose_model({{{0, 1.4124}, {1, 1.4102}, {2, 1.4130}}, 1.7339});
  ASSERT_TRUE(choice.replica);
  EXPECT_EQ(*choice.replica, 1);
  EXPECT_NE(choice.why.find("1.7339"), std::string::npos) << choice.why;
  // Among equals the lowest number; the mean not validated: the best replica.
  choice = choose_model({{{3, 2.0}, {1, 2.0}, {2, 2.1}}, std::nullopt});
  ASSERT_TRUE(choice.replica);
  EXPECT_EQ(*choice.replica, 1);
  // Nothing to choose between: one replica, or no validation at all.
  EXPECT_FALSE(choose_model({{{0, 2.0}}, std::nullopt}).replica);
  EXPECT_FALSE(choose_model({}).replica);
}

TEST(ModelChoice, ValidationIsReadByStepTheLatestRecordOfAReEvaluatedStepWinning) {
  TempDir dir;
  std::ofstream(dir.path() + "/metrics.jsonl")
      << R"({"split":"train","step":10,"loss":3.0,"replica":0})" "\n"
      << R"({"split":"val","step":10,"loss":2.5,"replica":0,"loss_mean_model":2.4})" "\n"
      << R"({"split":"val","step":10,"loss":2.6,"replica":1})" "\n"
      << R"({"split":"val","step":10,"loss":2.55,"replica":1})" "\n"  // a resume evaluated it again
      << "not json, a torn line\n"
      << R"({"split":"val","step":20,"loss":2.2,"replica":1})" "\n";
  const auto by_step = validated_models(dir.path());
  ASSERT_EQ(by_step.size(), 2u);
  const auto& at10 = by_step.at(10);
  EXPECT_EQ(at10.replica_loss, (std::map<int, double>{{0, 2.5}, {1, 2.55}}));
  EXPECT_EQ(at10.mean_model_loss, 2.4);
  EXPECT_FALSE(by_step.at(20).mean_model_loss);
  EXPECT_TRUE(validated_models(dir.path() + "/nothing").empty());
}

// Both figures in summary.json, and the model export takes by them.
TEST(RunSummary, StatesTheBestReplicaAndTheModelExportTakes) {
  TempDir dir;
  const auto worker = [&](int rank, double loss, double mean_loss) {
    WorkerSummary w;
    w.method = Method::noloco;
    w.replicas = 3;
    w.replica = rank;
    w.steps = 100;
    w.final_val_loss = loss;
    w.final_val_loss_mean_model = mean_loss;
    write_json_atomic(fmt::format("{}/summary_r{}.json", dir.path(), rank), w.to_json());
    return WorkerExit{rank};
  };
  auto run = summarize_run(dir.path(), Method::noloco, 3, 1, "", 1,
                           {worker(0, 1.41, 1.73), worker(1, 1.40, 1.73), worker(2, 1.42, 1.73)}, 10.0);
  EXPECT_EQ(run.best_replica, 1);
  EXPECT_EQ(run.final_val_loss_best_replica, 1.40);
  EXPECT_EQ(run.handed_over, "replica 1");
  const auto back = RunSummary::from_json(run.to_json());
  EXPECT_EQ(back.handed_over, "replica 1");
  EXPECT_EQ(back.final_val_loss_best_replica, 1.40);
  run = summarize_run(dir.path(), Method::noloco, 3, 1, "", 1,
                      {worker(0, 1.41, 1.35), worker(1, 1.40, 1.35), worker(2, 1.42, 1.35)}, 10.0);
  EXPECT_EQ(run.handed_over, "mean");
}

// Issue 105: users see each replica's pace; a run whose replicas all trained
// every slot adds nothing.
TEST(RunSummary, ThePaceTableShowsOnlyRunsWhoseReplicasTrainedUnequalSteps) {
  TempDir dir;
  const auto run = [&](const std::string& name, std::vector<double> per_period) {
    RunSummary s;
    s.method = Method::noloco;
    s.steps_per_second_replicas = {36.7, 115.5, 91.3};
    s.steps_per_outer_step_replicas = std::move(per_period);
    s.outer_blocked_seconds_replicas = {0.4, 2.5, 1.0};
    const auto path = dir.path() + "/" + name;
    std::filesystem::create_directories(path);
    write_json_atomic(path + "/summary.json", s.to_json());
    return path;
  };
  const auto equal = run("equal", {50, 50, 50}), paced = run("paced", {12.7, 39.8, 32.2});
  EXPECT_EQ(pace_table({equal}), "");
  const auto table = pace_table({equal, paced});
  EXPECT_NE(table.find("| paced | 36.7–115.5 | 12.7–39.8 | 0.4–2.5 |"), std::string::npos) << table;
  EXPECT_EQ(table.find("| equal |"), std::string::npos) << table;
  EXPECT_NE(comparison_table({paced}).find(table), std::string::npos);
}
