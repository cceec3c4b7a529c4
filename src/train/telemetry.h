// Where a worker's numbers go. The training loop builds one record per event
// (a logged step, an outer step, an evaluation, a rejoin) and hands it to the
// sink once; the sink appends it to metrics.jsonl (one JSON object per line,
// a single write, so replicas can share the file), writes its scalars to the
// worker's TensorBoard event file, and prints the progress line when this
// worker is the one that speaks; and hands it to `observer` (the live
// status, comm/view/status_board.h) where there is one.
#pragma once
#include <functional>
#include <memory>
#include <string>

#include <nlohmann/json.hpp>

namespace noloco {

class EventWriter;

// metrics.jsonl alone.
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

class Telemetry {
 public:
  // TensorBoard under run_dir/tensorboard/replica_<worker>; progress lines
  // (of `total_steps`) on the console if `console`, each with the partners
  // of the last outer step and how their links went.
  Telemetry(const std::string& run_dir, int worker, int64_t total_steps, bool console,
            std::function<void(const nlohmann::json&)> observer = {});
  ~Telemetry();
  // Records carry "split" (train, val, outer, rejoin, donate) and "step".
  void write(const nlohmann::json& record);

 private:
  void print(const nlohmann::json& record) const;
  MetricsLog metrics_;
  std::string last_exchange_;  // "with 3 (punched)", "alone"; empty before the first outer step
  std::unique_ptr<EventWriter> tensorboard_;
  int64_t total_steps_;
  bool console_;
  std::function<void(const nlohmann::json&)> observer_;
};

}  // namespace noloco
