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
};

struct PlotOptions {
  std::string title, x_label, y_label;
  bool log_y = false;
  bool log_x = false;
  bool x_bytes = false;  // tick the x axis in bytes ("56 MB"), not in numbers ("5.6e+07")
};

// The legend sits right of the plot; the picture widens to hold its longest name.
std::string line_chart_svg(const std::vector<PlotSeries>& series, const PlotOptions& options);

}  // namespace noloco
