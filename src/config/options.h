// Named options bound to variables: the one parser of `key=value` for config
// files, command-line overrides and every subcommand's arguments, and the
// source of their --help text.
#pragma once
#include <cstdint>
#include <functional>
#include <optional>
#include <type_traits>
#include <string>
#include <vector>

#include "config/choices.h"

namespace noloco {

class Options {
 public:
  explicit Options(std::string what) : what_(std::move(what)) {}

  // Binds `name` to `target` (int, int64_t, uint64_t, double, bool,
  // std::string, a choice of config/choices.h, or std::optional of a number:
  // unset reads and writes as empty text).
  template <class T>
  Options& add(const std::string& name, T& target, const std::string& help);

  // Sets one option from text; throws std::invalid_argument naming the key.
  void set(const std::string& name, const std::string& value);
  // The option's current value as text (what `set` would read back).
  std::string get(const std::string& name) const;
  bool has(const std::string& name) const;

  // Applies every "key=value" in `args`; an unknown key or a word without
  // '=' is an error naming it.
  void parse(const std::vector<std::string>& args);
  // Applies the "key=value" arguments whose key is known and returns the others, in order.
  std::vector<std::string> parse_known(const std::vector<std::string>& args);

  struct Option {
    std::string name, help;
    std::function<void(const std::string&)> set;
    std::function<std::string()> get;
  };
  const std::vector<Option>& all() const { return options_; }
  // One entry a key: its name, its help and its current value (the default,
  // on options bound to a default-constructed target), wrapped at `width` columns.
  std::string help(size_t width = 100) const;

 private:
  const Option* find(const std::string& name) const;
  std::string what_;
  std::vector<Option> options_;
};

// Splits "key=value"; throws std::invalid_argument if there is no key.
std::pair<std::string, std::string> split_key_value(const std::string& arg);

// Typed text conversion shared by all options (strict: the whole text must parse).
template <class T>
T parse_option_value(const std::string& key, const std::string& text);
template <class T>
std::string format_option_value(const T& value);

template <class T>
struct is_optional : std::false_type {};
template <class T>
struct is_optional<std::optional<T>> : std::true_type {};

template <class T>
Options& Options::add(const std::string& name, T& target, const std::string& help) {
  T* p = &target;
  if constexpr (is_optional<T>::value && !is_choice<T>::value)
    options_.push_back({name, help,
                        [p, name](const std::string& v) {
                          *p = v.empty() ? T{} : T{parse_option_value<typename T::value_type>(name, v)};
                        },
                        [p] { return *p ? format_option_value(**p) : std::string(); }});
  else if constexpr (is_choice<T>::value)
    options_.push_back({name, help, [p, name](const std::string& v) { *p = parse_choice<T>(name, v); },
                        [p] { return choice_name(*p); }});
  else
    options_.push_back({name, help, [p, name](const std::string& v) { *p = parse_option_value<T>(name, v); },
                        [p] { return format_option_value(*p); }});
  return *this;
}

}  // namespace noloco
