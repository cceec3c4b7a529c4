#include "util/stop_signal.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <stdexcept>

namespace noloco {

namespace {
int stop_pipe[2] = {-1, -1};
std::atomic<bool> signalled{false};
}  // namespace

bool stop_signalled() { return signalled.load(); }

void stop_on_signal() {
  if (::pipe2(stop_pipe, O_CLOEXEC) != 0) throw std::runtime_error("no pipe for the stop signal");
  struct sigaction sa {};
  sa.sa_handler = [](int signal) {
    signalled = true;
    const char s = char(signal);
    (void)!::write(stop_pipe[1], &s, 1);
  };
  sa.sa_flags = SA_RESTART;
  ::sigemptyset(&sa.sa_mask);
  ::sigaction(SIGTERM, &sa, nullptr);
  ::sigaction(SIGINT, &sa, nullptr);
}

int wait_for_stop() {
  for (;;) {
    char s = 0;
    const auto n = ::read(stop_pipe[0], &s, 1);
    if (n == 1) return s;
    if (n < 0 && errno == EINTR) continue;
    return 0;
  }
}

int wait_for_stop(std::chrono::milliseconds at_most) {
  pollfd p{stop_pipe[0], POLLIN, 0};
  const int ready = ::poll(&p, 1, int(at_most.count()));
  return ready == 1 ? wait_for_stop() : 0;
}

}  // namespace noloco
