#include "util/progress.h"

#include <unistd.h>

#include <cstdio>

#include <fmt/format.h>

#include "util/human.h"

namespace noloco {

Progress::Progress(std::string what, int64_t total)
    : what_(std::move(what)), total_(total), tty_(::isatty(STDOUT_FILENO) != 0),
      start_(std::chrono::steady_clock::now()), last_(start_) {}

void Progress::update(int64_t done, const std::string& detail) {
  const auto now = std::chrono::steady_clock::now();
  const bool finished = done >= total_;
  // A terminal redraws often; a log gets a line every 10 seconds.
  const double interval = tty_ ? 0.2 : 10.0;
  if (!finished && std::chrono::duration<double>(now - last_).count() < interval) return;
  last_ = now;
  const double elapsed = std::chrono::duration<double>(now - start_).count();
  const double eta = done > 0 ? elapsed / double(done) * double(total_ - done) : -1;
  const auto line = fmt::format("{} {}/{} ({:.0f}%) | {} elapsed | eta {}{}{}", what_, done, total_,
                                100.0 * double(done) / double(std::max<int64_t>(1, total_)), format_duration(elapsed),
                                format_duration(eta), detail.empty() ? "" : " | ", detail);
  if (tty_) {
    fmt::print("\r{}\x1b[K{}", line, finished ? "\n" : "");
  } else {
    fmt::print("{}\n", line);
  }
  std::fflush(stdout);
}

}  // namespace noloco
