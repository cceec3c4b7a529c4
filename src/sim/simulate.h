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
  uint64_t seed = 1;
};

// Throws std::invalid_argument, in one line, on values out of range or an unknown model.
void validate(const SimulateOptions& options);
// Writes latency.csv, bandwidth.csv, idle.csv, fig5a.svg, fig5b.svg into options.out;
// returns the headline figures.
nlohmann::json run_simulation(const SimulateOptions& options);

}  // namespace noloco::sim
