// `noloco bench comm`: N local workers exchange model-sized buffers exactly
// as each method's outer step does (the real c10d code path), optionally
// after log-normally jittered compute, and report sync and idle time.
#pragma once
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "comm/communicator.h"
#include "train/config.h"

namespace noloco {

struct CommBenchOptions {
  double megabytes = 3.48;  // the Shakespeare model's fp32 size
  int rounds = 20;
  double compute = 0;  // mean seconds of "compute" before each sync
  double sigma2 = 0;   // variance of the log-normal compute jitter (the paper: 0.5)
  double straggler = 1;  // worker 0 computes this many times longer
};

// Splits bench-comm keys (megabytes, rounds, compute, sigma2, straggler) from config keys.
CommBenchOptions parse_comm_bench_options(std::vector<std::string>& args);
// One worker's measurement; written to out/bench_comm_r<rank>.json.
nlohmann::json comm_bench_worker(const TrainConfig& c, const CommBenchOptions& o, Communicator& comm);
// Launcher side: mean over workers, appended as a row to out/bench_comm.csv.
nlohmann::json summarize_comm_bench(const TrainConfig& c, const CommBenchOptions& o);

}  // namespace noloco
