#include "config/options.h"

#include <algorithm>
#include <limits>
#include <stdexcept>

#include <fmt/format.h>

#include "util/human.h"
#include "util/parse_number.h"

namespace noloco {

namespace {
[[noreturn]] void invalid(const std::string& m) { throw std::invalid_argument(m); }
}  // namespace

template <>
int64_t parse_option_value<int64_t>(const std::string& key, const std::string& s) {
  return parse_integer(key, s);
}
template <>
int parse_option_value<int>(const std::string& key, const std::string& s) {
  const int64_t v = parse_integer(key, s);
  if (v < std::numeric_limits<int>::min() || v > std::numeric_limits<int>::max())
    invalid(fmt::format("{}: {} is out of range", key, s));
  return int(v);
}
template <>
uint64_t parse_option_value<uint64_t>(const std::string& key, const std::string& s) {
  const int64_t v = parse_integer(key, s);
  if (v < 0) invalid(fmt::format("{}: must be non-negative, got {}", key, s));
  return uint64_t(v);
}
template <>
double parse_option_value<double>(const std::string& key, const std::string& s) {
  return parse_real(key, s);
}
template <>
bool parse_option_value<bool>(const std::string& key, const std::string& s) {
  if (s == "true" || s == "1" || s == "yes" || s == "on") return true;
  if (s == "false" || s == "0" || s == "no" || s == "off") return false;
  invalid(fmt::format("{}: '{}' is not a boolean", key, s));
}
template <>
std::string parse_option_value<std::string>(const std::string&, const std::string& s) {
  return s;
}

template <>
std::string format_option_value(const std::string& v) {
  return v;
}
template <>
std::string format_option_value(const bool& v) {
  return v ? "true" : "false";
}
template <>
std::string format_option_value(const double& v) {
  return fmt::format("{}", v);
}
template <>
std::string format_option_value(const int& v) {
  return std::to_string(v);
}
template <>
std::string format_option_value(const int64_t& v) {
  return std::to_string(v);
}
template <>
std::string format_option_value(const uint64_t& v) {
  return std::to_string(v);
}

std::pair<std::string, std::string> split_key_value(const std::string& arg) {
  const auto eq = arg.find('=');
  if (eq == std::string::npos || eq == 0) invalid(fmt::format("'{}' is not key=value", arg));
  return {arg.substr(0, eq), arg.substr(eq + 1)};
}

const Options::Option* Options::find(const std::string& name) const {
  for (const auto& o : options_)
    if (o.name == name) return &o;
  return nullptr;
}

bool Options::has(const std::string& name) const { return find(name) != nullptr; }

void Options::set(const std::string& name, const std::string& value) {
  const auto* o = find(name);
  if (!o) {
    std::string known;
    for (const auto& k : options_) known += (known.empty() ? "" : ", ") + k.name;
    invalid(fmt::format("unknown {} key '{}' (known: {})", what_, name, known));
  }
  o->set(value);
}

std::string Options::get(const std::string& name) const {
  const auto* o = find(name);
  if (!o) invalid(fmt::format("unknown {} key '{}'", what_, name));
  return o->get();
}

void Options::parse(const std::vector<std::string>& args) {
  for (const auto& a : args) {
    const auto [key, value] = split_key_value(a);
    set(key, value);
  }
}

std::vector<std::string> Options::parse_known(const std::vector<std::string>& args) {
  std::vector<std::string> rest;
  for (const auto& a : args) {
    const auto eq = a.find('=');
    if (eq != std::string::npos && has(a.substr(0, eq))) {
      set(a.substr(0, eq), a.substr(eq + 1));
    } else {
      rest.push_back(a);
    }
  }
  return rest;
}

std::string Options::help(size_t width) const {
  constexpr size_t kKeyColumn = 24;
  std::string s;
  for (const auto& o : options_) {
    auto value = o.get();
    // A default of control characters (generate's prompt, a newline) shows as its escape.
    for (size_t pos = 0; (pos = value.find('\n', pos)) != std::string::npos; pos += 2) value.replace(pos, 1, "\\n");
    const auto first = fmt::format("  {:<{}} ", o.name, kKeyColumn - 3);
    const auto text = fmt::format("{} [default: {}]", o.help, value.empty() ? "unset" : value);
    // A key longer than its column starts its text on the next line.
    s += first.size() > kKeyColumn ? first + "\n" + wrap_words(std::string(kKeyColumn, ' '), text, width)
                                   : wrap_words(first, text, width);
  }
  return s;
}

}  // namespace noloco
