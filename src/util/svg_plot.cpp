#include "util/svg_plot.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <set>

#include <fmt/format.h>

#include "util/human.h"

namespace noloco {

namespace {

constexpr double kWidth = 820, kHeight = 420, kLeft = 80, kRight = 260, kTop = 40, kBottom = 60;
// A generous width of one character of the 12 px sans-serif text (most are
// narrower), so a name is never clipped at the picture's right edge and
// labels that could touch are kept apart.
constexpr double kCharWidth = 7.2;
// Room left of the y tick labels for the axis title (rotated, 12 px high).
constexpr double kYTitleRoom = 34;

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
  // Multiples of the step, not sums of it: a sum drifts, and a tick meant to be 0 read "-0".
  std::vector<double> ticks;
  for (double k = std::ceil(lo / step); k * step <= hi + step * 1e-9; ++k) ticks.push_back(k == 0 ? 0.0 : k * step);
  return ticks;
}

bool wants_exponent(double v) {
  const double a = std::abs(v);
  return a != 0 && (a >= 1e5 || a < 1e-3);
}

std::string tick_label(double v, int digits, bool exponent) {
  if (exponent && v != 0) return fmt::format("{:.{}e}", v, std::max(1, digits - 3));
  // %g turns to an exponent from 10^digits on (1500 read "1.5e+03", and
  // then "1500.00000" once given the decimals of that label); short of
  // wants_exponent's bound, the whole number is the label.
  const auto label = fmt::format("{:.{}g}", v, digits);
  return label.find('e') == std::string::npos ? label : fmt::format("{:.0f}", v);
}

size_t decimals_of(const std::string& label) {
  const auto dot = label.find('.');
  return dot == std::string::npos ? 0 : label.size() - dot - 1;
}

// Labels of `values` (ascending), with the fewest digits (3 at least) that
// tell each from its neighbours: a narrow range printed "1.914" four times.
// One form for all: where one needs an exponent, all have one (a column
// read 0.003162 beside 5.6e-04); evenly spaced values (a linear axis's
// ticks) all carry as many decimals as the one that needs most (2.1 beside
// 2.105).
std::vector<std::string> number_labels(const std::vector<double>& values, bool evenly_spaced) {
  const bool exponent = std::any_of(values.begin(), values.end(), wants_exponent);
  std::vector<std::string> out;
  for (int digits = 3; digits <= 12; ++digits) {
    out.clear();
    for (const double v : values) out.push_back(tick_label(v, digits, exponent));
    if (std::adjacent_find(out.begin(), out.end()) == out.end()) break;
  }
  if (exponent || !evenly_spaced) return out;
  size_t decimals = 0;
  for (const auto& label : out) decimals = std::max(decimals, decimals_of(label));
  for (size_t i = 0; i < out.size(); ++i) out[i] = fmt::format("{:.{}f}", values[i], decimals);
  return out;
}

double text_width(const std::string& text) { return kCharWidth * double(text.size()); }
// An upright label's width across the axis: one line of 12 px text.
constexpr double kUprightLabelWidth = 13;

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

// The texts of an x axis's ticks (transformed values, as the axis is).
std::vector<std::string> x_tick_texts(const std::vector<double>& ticks, const PlotOptions& o) {
  std::vector<double> values;
  for (const double t : ticks) values.push_back(o.log_x ? std::pow(10, t) : t);
  if (!o.x_bytes) return number_labels(values, !o.log_x);
  std::vector<std::string> out;
  for (const double v : values) out.push_back(format_bytes(v));
  return out;
}

// The x axis under a frame whose bottom is at `bottom`: each tick's grid line
// and label, and how far below the frame the labels reach.
struct XAxis {
  std::string svg;
  double label_depth = 0;
};

// Ticks at pixels `at`, ascending. The labels share one row where each keeps
// clear of the next; otherwise all stand upright (read bottom to top), so
// that close rates on a log axis (0.64 beside 0.7) each keep their own
// (staggered over two rows they read as one jumble), and an upright label
// that would touch the one before it is left out.
XAxis x_tick_marks(const std::vector<double>& at, const std::vector<std::string>& texts, double bottom) {
  bool one_row = true;
  for (size_t i = 1; i < at.size(); ++i)
    one_row = one_row && at[i] - text_width(texts[i]) / 2 >= at[i - 1] + text_width(texts[i - 1]) / 2 + 6;
  XAxis axis;
  double free_from = -std::numeric_limits<double>::infinity();
  for (size_t i = 0; i < at.size(); ++i) {
    axis.svg += fmt::format("<line x1=\"{0:.1f}\" y1=\"{1}\" x2=\"{0:.1f}\" y2=\"{2}\" stroke=\"#ddd\"/>", at[i],
                            kTop, bottom);
    if (one_row) {
      axis.svg += fmt::format("<text x=\"{:.1f}\" y=\"{}\" text-anchor=\"middle\">{}</text>", at[i], bottom + 16,
                              texts[i]);
      axis.label_depth = 16;
    } else if (at[i] - kUprightLabelWidth / 2 >= free_from) {
      const double x = at[i] + 4, y = bottom + 6;  // 4: the glyphs' middle on the tick
      axis.svg += fmt::format("<text x=\"{0:.1f}\" y=\"{1:.1f}\" text-anchor=\"end\" transform=\"rotate(-90 {0:.1f} "
                              "{1:.1f})\">{2}</text>",
                              x, y, texts[i]);
      free_from = at[i] + kUprightLabelWidth / 2 + 2;
      axis.label_depth = std::max(axis.label_depth, 6 + text_width(texts[i]));
    }
    axis.svg += "\n";
  }
  return axis;
}

// A y tick's grid line across the frame at height `at`, and its label left of it.
std::string y_tick_mark(double at, const std::string& text, double left, double right, const char* dashes) {
  return fmt::format("<line x1=\"{0}\" y1=\"{1:.1f}\" x2=\"{2}\" y2=\"{1:.1f}\" stroke=\"#ddd\"{3}/>"
                     "<text x=\"{4}\" y=\"{5:.1f}\" text-anchor=\"end\">{6}</text>\n",
                     left, at, right, dashes, left - 6, at + 4, text);
}

// One series at the pixels `at` of its drawable points, and its line of the
// legend at (lx, ly), drawn as the plot draws it: a line, a dot, or both.
std::string series_marks(const PlotSeries& s, const std::vector<std::pair<double, double>>& at, double lx, double ly,
                         const std::string& name) {
  const bool line = at.size() > 1, dotted = !at.empty() && (s.markers || at.size() == 1);
  const char* dashes = s.dashed ? " stroke-dasharray=\"6,4\"" : "";
  std::string svg, points, dots;
  for (const auto& [x, y] : at) {
    points += fmt::format("{:.1f},{:.1f} ", x, y);
    if (dotted) dots += fmt::format("<circle cx=\"{:.1f}\" cy=\"{:.1f}\" r=\"4\" fill=\"{}\"/>", x, y, s.color);
  }
  if (line)
    svg += fmt::format("<polyline fill=\"none\" stroke=\"{}\" stroke-width=\"2\"{} points=\"{}\"/>\n", s.color, dashes,
                       points);
  if (!dots.empty()) svg += dots + "\n";
  if (line || !dotted)
    svg += fmt::format("<line x1=\"{0}\" y1=\"{1}\" x2=\"{2}\" y2=\"{1}\" stroke=\"{3}\" stroke-width=\"2\"{4}/>", lx,
                       ly, lx + 24, s.color, dashes);
  if (dotted) svg += fmt::format("<circle cx=\"{}\" cy=\"{}\" r=\"4\" fill=\"{}\"/>", lx + 12, ly, s.color);
  svg += fmt::format("<text x=\"{}\" y=\"{}\">{}</text>\n", lx + 30, ly + 4, escape(name));
  return svg;
}

// [low, high] widened about its middle to at least `share` of the middle.
void widen_to_share(double& low, double& high, double share) {
  const double middle = (low + high) / 2, half = share * std::abs(middle) / 2;
  if (high - low < 2 * half) low = middle - half, high = middle + half;
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
  // A 0 on a log y axis (replicas that are equal at a synchronisation) is
  // drawn on a line of its own below the axis's lowest value, labelled 0:
  // dropped, it made DiLoCo look as if it never synchronised.
  auto zero_on_log = [&](double x, double y) { return o.log_y && y == 0 && std::isfinite(x) && !(o.log_x && x <= 0); };
  bool zeros = false;
  for (auto& s : series)
    for (auto& [x, y] : s.points) {
      zeros = zeros || zero_on_log(x, y);
      if (!usable(x, y)) continue;
      x0 = std::min(x0, tx(x)), x1 = std::max(x1, tx(x));
      y0 = std::min(y0, ty(y)), y1 = std::max(y1, ty(y));
    }
  const bool any = std::isfinite(x0);
  zeros = zeros && any;
  if (!any) x0 = 0, x1 = 1, y0 = 0, y1 = 1;
  for (auto& s : series)
    for (auto& [x, y] : s.points)
      if (zeros && zero_on_log(x, y)) x0 = std::min(x0, tx(x)), x1 = std::max(x1, tx(x));
  if (x1 == x0) x1 = x0 + 1;
  // Dots at the ends of a log axis (runs against their rates) would sit on the frame.
  if (o.log_x) {
    const double x_pad = (x1 - x0) * 0.04;
    x0 -= x_pad, x1 += x_pad;
  }
  if (!o.log_y && any) widen_to_share(y0, y1, o.min_relative_y_span);
  if (y1 == y0) y1 = y0 + 1;
  const double pad = (y1 - y0) * 0.05;
  y0 -= pad, y1 += pad;
  const auto y_ticks = nice_ticks(y0, y1);
  const double zero_at = y0 - (y1 - y0) * 0.08;  // transformed
  if (zeros) y0 = zero_at - (y1 - y0) * 0.04;
  auto drawn_y = [&](double y) { return o.log_y && y == 0 ? zero_at : ty(y); };
  auto drawable = [&](double x, double y) { return usable(x, y) || (zeros && zero_on_log(x, y)); };

  std::vector<double> y_values;
  for (const double t : y_ticks) y_values.push_back(o.log_y ? std::pow(10, t) : t);
  auto y_texts = number_labels(y_values, !o.log_y);
  double widest = 0;
  for (const auto& t : y_texts) widest = std::max(widest, text_width(t));
  const double left = std::max(kLeft, kYTitleRoom + 6 + widest);
  const double pw = kWidth - kLeft - kRight, ph = kHeight - kTop - kBottom;
  std::vector<std::string> names;
  for (const auto& s : series) {
    const bool shown = std::any_of(s.points.begin(), s.points.end(), [&](auto& p) { return drawable(p.first, p.second); });
    names.push_back(shown ? s.name
                          : s.name + ((o.log_x || o.log_y) ? " (not drawn: nothing above 0 on the log axis)"
                                                           : " (not drawn: no finite value)"));
  }
  size_t longest = 0;
  for (const auto& name : names) longest = std::max(longest, name.size());
  const double width = std::max(left + kWidth - kLeft, left + pw + 42 + kCharWidth * double(longest) + 12);
  auto px = [&](double x) { return left + (tx(x) - x0) / (x1 - x0) * pw; };
  auto pxt = [&](double t) { return left + (t - x0) / (x1 - x0) * pw; };  // t already transformed
  auto pyt = [&](double t) { return kTop + (1 - (t - y0) / (y1 - y0)) * ph; };
  auto py = [&](double y) { return pyt(drawn_y(y)); };

  // On a log axis, round ticks in log space are odd numbers: tick the data's own x values instead.
  std::vector<double> x_ticks;
  if (o.log_x) {
    std::set<double> xs;
    for (auto& s : series)
      for (auto& [x, y] : s.points)
        if (drawable(x, y)) xs.insert(tx(x));
    if (xs.size() <= 12) x_ticks.assign(xs.begin(), xs.end());
  }
  if (x_ticks.empty()) x_ticks = nice_ticks(x0, x1);
  std::vector<double> x_at;
  for (const double t : x_ticks) x_at.push_back(pxt(t));
  const auto x_axis = x_tick_marks(x_at, x_tick_texts(x_ticks, o), kTop + ph);
  const double height = std::max(kHeight, kTop + ph + x_axis.label_depth + 30);  // the axis title below the labels
  std::string svg = fmt::format(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{}\" height=\"{}\" font-family=\"sans-serif\" "
      "font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
      "<text x=\"{}\" y=\"22\" font-size=\"15\" text-anchor=\"middle\">{}</text>\n",
      width, height, left + pw / 2, escape(o.title));
  svg += x_axis.svg;
  for (size_t i = 0; i < y_ticks.size(); ++i) svg += y_tick_mark(pyt(y_ticks[i]), y_texts[i], left, left + pw, "");
  if (zeros) svg += y_tick_mark(pyt(zero_at), "0", left, left + pw, " stroke-dasharray=\"2,3\"");
  svg += fmt::format("<rect x=\"{}\" y=\"{}\" width=\"{}\" height=\"{}\" fill=\"none\" stroke=\"#333\"/>\n", left, kTop,
                     pw, ph);
  svg += fmt::format("<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">{}{}</text>\n", left + pw / 2, height - 10,
                     escape(o.x_label), o.log_x ? " (log scale)" : "");
  svg += fmt::format("<text transform=\"translate(18,{}) rotate(-90)\" text-anchor=\"middle\">{}{}</text>\n",
                     kTop + ph / 2, escape(o.y_label), o.log_y ? " (log scale)" : "");
  for (size_t i = 0; i < series.size(); ++i) {
    std::vector<std::pair<double, double>> at;
    for (auto& [x, y] : series[i].points)
      if (drawable(x, y)) at.emplace_back(px(x), py(y));
    svg += series_marks(series[i], at, left + pw + 12, kTop + 14 + 20 * double(i), names[i]);
  }
  svg += "</svg>\n";
  return svg;
}

}  // namespace noloco
