// metrics.jsonl (one JSON object per line, appended; several replicas may share
// the file, each line is a single write) and the human progress line.
#pragma once
#include <string>

#include <nlohmann/json.hpp>

namespace noloco {

class MetricsLog {
 public:
  explicit MetricsLog(const std::string& path);
  ~MetricsLog();
  MetricsLog(const MetricsLog&) = delete;
  MetricsLog& operator=(const MetricsLog&) = delete;
  void write(const nlohmann::json& record);

 private:
  int fd_ = -1;
  std::string path_;
};

// "1h02m", "3m07s", "12s"
std::string format_duration(double seconds);
// "12.3k", "4.56M"
std::string format_count(double n);

}  // namespace noloco
