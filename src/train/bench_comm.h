// `noloco bench comm`: N local workers run the methods' own outer steps
// (DDP's gradient all-reduce, DiLoCo's and NoLoCo's exchanges, with their
// wire formats) on model-sized buffers, optionally after log-normally
// jittered compute, and report sync and idle time.
#pragma once
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "config/train_config.h"
#include "optim/outer.h"

namespace noloco {

struct CommBenchOptions {
  double megabytes = 3.48;  // the Shakespeare model's fp32 size
  int rounds = 20;
  double compute = 0;  // mean seconds of "compute" before each sync
  double sigma2 = 0;   // variance of the log-normal compute jitter (the paper: 0.5)
  double straggler = 1;  // worker 0 computes this many times longer
};

// Throws std::invalid_argument on values out of range.
void validate(const CommBenchOptions& o);
// One worker's measurement; written to out/bench_comm_r<rank>.json.
nlohmann::json comm_bench_worker(const TrainConfig& c, const CommBenchOptions& o, ReplicaPeers links);
// Launcher side: mean over workers, appended as a row to out/bench_comm.csv.
nlohmann::json summarize_comm_bench(const TrainConfig& c, const CommBenchOptions& o);

}  // namespace noloco
