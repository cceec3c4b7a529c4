#include "util/human.h"

#include <algorithm>
#include <cmath>
#include <iterator>
#include <cstdint>

#include <fmt/format.h>

namespace noloco {

std::string format_duration(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "?";
  const auto s = int64_t(seconds + 0.5);
  if (s >= 3600) return fmt::format("{}h{:02d}m", s / 3600, (s % 3600) / 60);
  if (s >= 60) return fmt::format("{}m{:02d}s", s / 60, s % 60);
  return fmt::format("{}s", s);
}

std::string format_count(double n) {
  if (!std::isfinite(n)) return "?";
  if (n >= 1e9) return fmt::format("{:.2f}G", n / 1e9);
  if (n >= 1e6) return fmt::format("{:.2f}M", n / 1e6);
  if (n >= 1e3) return fmt::format("{:.1f}k", n / 1e3);
  return fmt::format("{:.0f}", n);
}

std::string format_bytes(double bytes) {
  if (!std::isfinite(bytes)) return "?";
  const char* units[] = {"B", "kB", "MB", "GB", "TB", "PB"};
  size_t unit = 0;
  while (std::abs(bytes) >= 999.5 && unit + 1 < std::size(units)) bytes /= 1000, ++unit;
  return fmt::format("{:.3g} {}", bytes, units[unit]);
}

std::string wrap_words(const std::string& first, const std::string& text, size_t width) {
  std::string out = first, line = first;
  const std::string indent(first.size(), ' ');
  size_t pos = 0;
  while (pos < text.size()) {
    const size_t end = std::min(text.find(' ', pos), text.size());
    const std::string word = text.substr(pos, end - pos);
    pos = end + 1;
    if (word.empty()) continue;
    const bool fresh = line.size() == indent.size();
    if (!fresh && line.size() + 1 + word.size() > width) {
      out += "\n" + indent;
      line = indent;
    } else if (!fresh) {
      out += " ";
      line += " ";
    }
    out += word;
    line += word;
  }
  return out + "\n";
}

std::string one_line(const std::string& text, size_t max_bytes) {
  std::string out;
  bool cut = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char ch = text[i];
    if (ch == '\n' || ch == '\r') {
      const bool follows_break = i > 0 && (text[i - 1] == '\n' || text[i - 1] == '\r');
      if (!out.empty() && !follows_break) out += " | ";
    } else {
      out += ch;
    }
    if (out.size() > max_bytes) {
      cut = true;
      break;
    }
  }
  if (!cut) return out;
  out.resize(max_bytes);
  // Back to the start of the character the cut fell in, unless it ended there.
  size_t start = out.size();
  while (start > 0 && (uint8_t(out[start - 1]) & 0xC0) == 0x80) --start;
  if (start > 0 && uint8_t(out[start - 1]) >= 0xC0) {
    const uint8_t lead = uint8_t(out[start - 1]);
    const size_t length = lead >= 0xF0 ? 4 : lead >= 0xE0 ? 3 : 2;
    if (out.size() - (start - 1) < length) out.resize(start - 1);
  }
  return out;
}

}  // namespace noloco
