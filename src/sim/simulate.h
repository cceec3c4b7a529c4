// `noloco simulate`: the paper's communication figures at up to 1024 replicas.
#pragma once
#include <map>
#include <string>

#include <nlohmann/json.hpp>

namespace noloco::sim {

struct SimulateOptions {
  std::string out = "runs/simulate";
  int samples = 2000;       // Monte-Carlo draws per latency point
  int outer_steps = 100;    // outer steps per idle-time run
  int max_replicas = 1024;
  std::string model = "125m";
  double step_seconds = 0.5;  // compute time per inner step, for the bandwidth table
  // Unequal machines: the replicas' speeds (comm_model.h's replica_speeds),
  // and how long a paced NoLoCo replica waits for a late partner, as a
  // share of a typical replica's outer period.
  std::string speeds = "lognormal:0.5";
  double late_bound = 0.25;
  uint64_t seed = 1;
};

// Throws std::invalid_argument, in one line, on values out of range or an unknown model.
void validate(const SimulateOptions& options);
// Writes latency.csv, bandwidth.csv, idle.csv, unequal.csv, fig5a.svg, fig5b.svg into options.out;
// returns the headline figures.
nlohmann::json run_simulation(const SimulateOptions& options);

}  // namespace noloco::sim
