// Small self-contained SVG line charts for reports: labelled axes, ticks, legend.
#pragma once
#include <string>
#include <utility>
#include <vector>

namespace noloco {

struct PlotSeries {
  std::string name;
  std::string color;  // any SVG colour
  bool dashed = false;
  std::vector<std::pair<double, double>> points;
  bool markers = false;  // a dot at each point (always where a series has one point to draw)
};

// The colour of the i-th of several runs: ten distinct ones, then again.
std::string series_color(size_t i);

struct PlotOptions {
  std::string title, x_label, y_label;
  bool log_y = false;
  bool log_x = false;
  bool x_bytes = false;  // tick the x axis in bytes ("56 MB"), not in numbers ("5.6e+07")
  // A linear y axis spans at least this share of its values' middle, so that
  // runs 0.15% apart do not fill the plot as if they were far apart (0: any span).
  double min_relative_y_span = 0;
};

// The legend sits right of the plot; the picture widens to hold its longest
// name. A series with nothing to draw (no finite point, or none above 0 on a
// log axis) says so in the legend instead of vanishing. Tick labels carry as
// many digits as it takes to tell neighbours apart.
std::string line_chart_svg(const std::vector<PlotSeries>& series, const PlotOptions& options);

}  // namespace noloco
