#include "util/parse_number.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <stdexcept>

#include <fmt/format.h>

namespace noloco {

int64_t parse_integer(const std::string& key, const std::string& text) {
  size_t used = 0;
  long long v = 0;
  try {
    v = std::stoll(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used == 0 || used != text.size())
    throw std::invalid_argument(fmt::format("{}: '{}' is not an integer", key, text));
  return v;
}

double parse_real(const std::string& key, const std::string& text) {
  size_t used = 0;
  double v = 0;
  try {
    v = std::stod(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used == 0 || used != text.size() || !std::isfinite(v))
    throw std::invalid_argument(fmt::format("{}: '{}' is not a finite number", key, text));
  return v;
}

double parse_non_negative(const std::string& key, const std::string& text) {
  const double v = parse_real(key, text);
  if (v < 0) throw std::invalid_argument(fmt::format("{}: must be >= 0, got {}", key, text));
  return v;
}

double parse_bit_rate(const std::string& key, const std::string& text) {
  size_t digits = 0;
  while (digits < text.size() && (std::isdigit(static_cast<unsigned char>(text[digits])) || text[digits] == '.'))
    ++digits;
  const std::string unit = text.substr(digits);
  const double factor = unit == "kbit" ? 1e3 : unit == "mbit" ? 1e6 : unit == "gbit" ? 1e9 : 0;
  if (digits == 0 || factor == 0)
    throw std::invalid_argument(
        fmt::format("{}: '{}' is not a rate (a number with kbit, mbit or gbit, e.g. 10mbit)", key, text));
  const double rate = parse_real(key, text.substr(0, digits)) * factor;
  if (!(rate >= 1e5 && rate <= 1e11))
    throw std::invalid_argument(fmt::format("{}: must be between 100kbit and 100gbit, got '{}'", key, text));
  return rate;
}

uint64_t parse_byte_size(const std::string& key, const std::string& text) {
  size_t digits = 0;
  while (digits < text.size() && (std::isdigit(static_cast<unsigned char>(text[digits])) || text[digits] == '.'))
    ++digits;
  const std::string unit = text.substr(digits);
  const double factor = unit.empty() || unit == "B" ? 1
                        : unit == "KB"             ? 1e3
                        : unit == "MB"             ? 1e6
                        : unit == "GB"             ? 1e9
                        : unit == "KiB"            ? 1024.0
                        : unit == "MiB"            ? 1048576.0
                        : unit == "GiB"            ? 1073741824.0
                                                   : 0;
  if (digits == 0 || factor == 0)
    throw std::invalid_argument(
        fmt::format("{}: '{}' is not a size (a number with B, KB, MB, GB, KiB, MiB or GiB, e.g. 2GB)", key, text));
  const double bytes = parse_real(key, text.substr(0, digits)) * factor;
  if (!(bytes >= 1 && bytes < 1e18)) throw std::invalid_argument(fmt::format("{}: '{}' is out of range", key, text));
  return uint64_t(bytes);
}

std::vector<std::string> comma_separated(const std::string& text) {
  std::vector<std::string> entries;
  for (size_t start = 0; start <= text.size();) {
    const size_t comma = std::min(text.find(',', start), text.size());
    if (comma > start) entries.push_back(text.substr(start, comma - start));
    start = comma + 1;
  }
  return entries;
}

HostPort parse_host_port(const std::string& what, const std::string& text, int max_port) {
  const auto colon = text.rfind(':');
  HostPort out{text.substr(0, colon), std::nullopt};
  if (out.host.empty()) throw std::invalid_argument(fmt::format("{} '{}' is not host:port", what, text));
  if (colon == std::string::npos) return out;
  const auto digits = text.substr(colon + 1);
  const bool number = !digits.empty() && digits.size() <= 5 && digits.find_first_not_of("0123456789") == std::string::npos;
  const int port = number ? std::stoi(digits) : 0;
  if (port < 1 || port > max_port)
    throw std::invalid_argument(fmt::format("{} '{}': no such port (a port is 1..{})", what, text, max_port));
  out.port = port;
  return out;
}

}  // namespace noloco
