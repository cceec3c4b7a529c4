// Progress with an ETA for long work: an in-place line on a terminal, plain
// periodic lines when stdout is a file or pipe (logs stay readable).
#pragma once
#include <chrono>
#include <cstdint>
#include <string>

namespace noloco {

class Progress {
 public:
  Progress(std::string what, int64_t total);
  // Reports `done` of `total`; prints when due (always at the end).
  void update(int64_t done, const std::string& detail = "");

 private:
  std::string what_;
  int64_t total_;
  bool tty_;
  std::chrono::steady_clock::time_point start_, last_;
};

}  // namespace noloco
