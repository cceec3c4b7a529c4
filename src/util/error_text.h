// An exception as one line for an error message: LibTorch's errors carry a
// backtrace after their first line, Gloo's name a source file in brackets
// first; the line is kept whole (brackets and all), the backtrace dropped.
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

inline std::string error_text(const std::exception& e) {
  const auto* torch_error = dynamic_cast<const c10::Error*>(&e);
  const std::string what = torch_error ? torch_error->what_without_backtrace() : e.what();
  return what.substr(0, what.find('\n'));
}

}  // namespace noloco
