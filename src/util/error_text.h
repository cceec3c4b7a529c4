// An exception as one line for an error message: LibTorch's errors carry a
// backtrace after their first line, Gloo's name a source file in brackets
// first; the line is kept (brackets and all), the backtrace dropped.
#pragma once
#include <exception>
#include <stdexcept>
#include <string>

#include <c10/util/Exception.h>

namespace noloco {

// A run stopped by SIGINT or SIGTERM: the program exits with 128 + signal.
struct Interrupted : std::runtime_error {
  explicit Interrupted(int sig) : std::runtime_error("interrupted by signal " + std::to_string(sig)), signal(sig) {}
  int signal;
};

// A line is cut past this many characters: an error may quote its input
// (a config value, a peer's message), which can be megabytes long.
constexpr size_t kErrorLineLength = 1000;

inline std::string error_text(const std::exception& e) {
  const auto* torch_error = dynamic_cast<const c10::Error*>(&e);
  const std::string what = torch_error ? torch_error->what_without_backtrace() : e.what();
  const auto line = what.substr(0, what.find('\n'));
  if (line.size() <= kErrorLineLength) return line;
  return line.substr(0, kErrorLineLength) + "... (" + std::to_string(line.size() - kErrorLineLength) +
         " more characters)";
}

}  // namespace noloco
