#include "util/svg_plot.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <functional>
#include <set>

#include <fmt/format.h>

#include "util/human.h"

namespace noloco {

namespace {

constexpr double kWidth = 820, kHeight = 420, kLeft = 80, kRight = 260, kTop = 40, kBottom = 60;
// A generous width of one character of the 12 px sans-serif legend (most are
// narrower), so a name is never clipped at the picture's right edge.
constexpr double kLegendCharWidth = 7.2;

// About five round tick values covering [lo, hi].
std::vector<double> nice_ticks(double lo, double hi) {
  const double span = hi - lo;
  const double raw = span / 5;
  const double mag = std::pow(10, std::floor(std::log10(raw)));
  double step = mag;
  for (double m : {1.0, 2.0, 2.5, 5.0, 10.0})
    if (m * mag >= raw) {
      step = m * mag;
      break;
    }
  std::vector<double> ticks;
  for (double t = std::ceil(lo / step) * step; t <= hi + step * 1e-9; t += step) ticks.push_back(t);
  return ticks;
}

std::string tick_label(double v, int digits) {
  const double a = std::abs(v);
  if (a != 0 && (a >= 1e5 || a < 1e-3)) return fmt::format("{:.{}e}", v, std::max(1, digits - 3));
  return fmt::format("{:.{}g}", v, digits);
}

// Labels of `values` (ascending), with the fewest digits (4 at least) that
// tell each from its neighbours: a narrow range printed "1.914" four times.
std::vector<std::string> tick_labels(const std::vector<double>& values,
                                     const std::function<std::string(double, int)>& label) {
  std::vector<std::string> out;
  for (int digits = 4; digits <= 12; ++digits) {
    out.clear();
    for (const double v : values) out.push_back(label(v, digits));
    if (std::adjacent_find(out.begin(), out.end()) == out.end()) break;
  }
  return out;
}

std::string escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '<') out += "&lt;";
    else if (c == '>') out += "&gt;";
    else if (c == '&') out += "&amp;";
    else out += c;
  }
  return out;
}

}  // namespace

std::string series_color(size_t i) {
  static const char* const palette[] = {"#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
                                        "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"};
  return palette[i % std::size(palette)];
}

std::string line_chart_svg(const std::vector<PlotSeries>& series, const PlotOptions& o) {
  double x0 = std::numeric_limits<double>::infinity(), x1 = -x0, y0 = x0, y1 = -x0;
  auto ty = [&](double y) { return o.log_y ? std::log10(std::max(y, 1e-300)) : y; };
  auto tx = [&](double x) { return o.log_x ? std::log10(std::max(x, 1e-300)) : x; };
  auto usable = [&](double x, double y) {
    return std::isfinite(x) && std::isfinite(y) && !(o.log_y && y <= 0) && !(o.log_x && x <= 0);
  };
  for (auto& s : series)
    for (auto& [x, y] : s.points) {
      if (!usable(x, y)) continue;
      x0 = std::min(x0, tx(x)), x1 = std::max(x1, tx(x));
      y0 = std::min(y0, ty(y)), y1 = std::max(y1, ty(y));
    }
  if (!std::isfinite(x0)) x0 = 0, x1 = 1, y0 = 0, y1 = 1;
  if (x1 == x0) x1 = x0 + 1;
  if (y1 == y0) y1 = y0 + 1;
  const double pad = (y1 - y0) * 0.05;
  y0 -= pad, y1 += pad;
  const double pw = kWidth - kLeft - kRight, ph = kHeight - kTop - kBottom;
  std::vector<std::string> names;
  for (const auto& s : series) {
    const bool drawable =
        std::any_of(s.points.begin(), s.points.end(), [&](auto& p) { return usable(p.first, p.second); });
    names.push_back(drawable ? s.name
                             : s.name + ((o.log_x || o.log_y) ? " (not drawn: nothing above 0 on the log axis)"
                                                              : " (not drawn: no finite value)"));
  }
  size_t longest = 0;
  for (const auto& name : names) longest = std::max(longest, name.size());
  const double width = std::max(kWidth, kLeft + pw + 42 + kLegendCharWidth * double(longest) + 12);
  auto px = [&](double x) { return kLeft + (tx(x) - x0) / (x1 - x0) * pw; };
  auto pxt = [&](double t) { return kLeft + (t - x0) / (x1 - x0) * pw; };  // t already transformed
  auto py = [&](double y) { return kTop + (1 - (ty(y) - y0) / (y1 - y0)) * ph; };

  std::string svg = fmt::format(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{}\" height=\"{}\" font-family=\"sans-serif\" "
      "font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
      "<text x=\"{}\" y=\"22\" font-size=\"15\" text-anchor=\"middle\">{}</text>\n",
      width, kHeight, kLeft + pw / 2, escape(o.title));
  // On a log axis, round ticks in log space are odd numbers: tick the data's own x values instead.
  std::vector<double> x_ticks;
  if (o.log_x) {
    std::set<double> xs;
    for (auto& s : series)
      for (auto& [x, y] : s.points)
        if (usable(x, y)) xs.insert(tx(x));
    if (xs.size() <= 12) x_ticks.assign(xs.begin(), xs.end());
  }
  if (x_ticks.empty()) x_ticks = nice_ticks(x0, x1);
  const auto x_label = [&](double t, int digits) {
    const double x = o.log_x ? std::pow(10, t) : t;
    return o.x_bytes ? format_bytes(x) : tick_label(x, digits);
  };
  const auto x_texts = tick_labels(x_ticks, x_label);
  for (size_t i = 0; i < x_ticks.size(); ++i)
    svg += fmt::format("<line x1=\"{0:.1f}\" y1=\"{1}\" x2=\"{0:.1f}\" y2=\"{2}\" stroke=\"#ddd\"/>"
                       "<text x=\"{0:.1f}\" y=\"{3}\" text-anchor=\"middle\">{4}</text>\n",
                       pxt(x_ticks[i]), kTop, kTop + ph, kTop + ph + 16, x_texts[i]);
  const auto y_ticks = nice_ticks(y0, y1);
  const auto y_texts =
      tick_labels(y_ticks, [&](double t, int digits) { return tick_label(o.log_y ? std::pow(10, t) : t, digits); });
  for (size_t i = 0; i < y_ticks.size(); ++i) {
    const double at = kTop + (1 - (y_ticks[i] - y0) / (y1 - y0)) * ph;
    svg += fmt::format("<line x1=\"{0}\" y1=\"{1:.1f}\" x2=\"{2}\" y2=\"{1:.1f}\" stroke=\"#ddd\"/>"
                       "<text x=\"{3}\" y=\"{4:.1f}\" text-anchor=\"end\">{5}</text>\n",
                       kLeft, at, kLeft + pw, kLeft - 6, at + 4, y_texts[i]);
  }
  svg += fmt::format("<rect x=\"{}\" y=\"{}\" width=\"{}\" height=\"{}\" fill=\"none\" stroke=\"#333\"/>\n", kLeft, kTop,
                     pw, ph);
  svg += fmt::format("<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">{}{}</text>\n", kLeft + pw / 2, kHeight - 18,
                     escape(o.x_label), o.log_x ? " (log scale)" : "");
  svg += fmt::format("<text transform=\"translate(18,{}) rotate(-90)\" text-anchor=\"middle\">{}{}</text>\n",
                     kTop + ph / 2, escape(o.y_label), o.log_y ? " (log scale)" : "");
  for (size_t i = 0; i < series.size(); ++i) {
    const auto& s = series[i];
    std::string points, dots;
    size_t drawn = 0;
    for (auto& [x, y] : s.points)
      if (usable(x, y)) ++drawn, points += fmt::format("{:.1f},{:.1f} ", px(x), py(y));
    for (auto& [x, y] : s.points)
      if (usable(x, y) && (s.markers || drawn == 1))
        dots += fmt::format("<circle cx=\"{:.1f}\" cy=\"{:.1f}\" r=\"4\" fill=\"{}\"/>", px(x), py(y), s.color);
    if (drawn > 1)
      svg += fmt::format("<polyline fill=\"none\" stroke=\"{}\" stroke-width=\"2\"{} points=\"{}\"/>\n", s.color,
                         s.dashed ? " stroke-dasharray=\"6,4\"" : "", points);
    if (!dots.empty()) svg += dots + "\n";
    const double ly = kTop + 14 + 20 * double(i);
    svg += fmt::format("<line x1=\"{0}\" y1=\"{1}\" x2=\"{2}\" y2=\"{1}\" stroke=\"{3}\" stroke-width=\"2\"{4}/>"
                       "<text x=\"{5}\" y=\"{6}\">{7}</text>\n",
                       kLeft + pw + 12, ly, kLeft + pw + 36, s.color, s.dashed ? " stroke-dasharray=\"6,4\"" : "",
                       kLeft + pw + 42, ly + 4, escape(names[i]));
  }
  svg += "</svg>\n";
  return svg;
}

}  // namespace noloco
