#include "util/process_stats.h"

#include <sys/resource.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <sstream>
#include <string>

namespace noloco {

double peak_rss_mib() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return double(usage.ru_maxrss) / 1024.0;  // Linux reports KiB
}

double seconds_since_process_start() {
  // Field 22 of /proc/self/stat, after the parenthesised name (which may hold
  // spaces): the start in clock ticks since boot; /proc/uptime: now since boot.
  std::ifstream stat("/proc/self/stat"), uptime("/proc/uptime");
  std::string text((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
  const auto close = text.rfind(')');
  if (close == std::string::npos) return 0;
  std::istringstream fields(text.substr(close + 2));
  std::string field;
  for (int i = 3; i <= 22 && fields >> field; ++i) {
  }
  double now = 0;
  uptime >> now;
  // A figure for the summary, not worth failing a run over: 0 where /proc says nothing usable.
  if (field.empty() || field.find_first_not_of("0123456789") != std::string::npos) return 0;
  const double started = double(std::stoll(field)) / double(::sysconf(_SC_CLK_TCK));
  return now > started ? now - started : 0;
}

double unix_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

std::string machine_name() {
  char host[256] = "localhost";
  ::gethostname(host, sizeof host - 1);
  return host;
}

}  // namespace noloco
