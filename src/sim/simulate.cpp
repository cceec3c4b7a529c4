#include "sim/simulate.h"

#include <cmath>
#include <filesystem>

#include <fmt/format.h>

#include "config/model_config.h"
#include "sim/comm_model.h"
#include "util/files.h"
#include "util/progress.h"
#include "util/svg_plot.h"
#include "util/run_files.h"

namespace noloco::sim {

namespace {

const char* kColors[] = {"#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b"};

// Unequal machines: the work done per second against every replica at its own pace, today's schedule
// (H inner steps each) and the paced one. The paper's H: DiLoCo 100, NoLoCo 50; steps jitter by 25%.
void write_unequal_table(const SimulateOptions& o, nlohmann::json& headline) {
  std::string csv = "replicas,speeds,method,schedule,throughput_over_ideal\n";
  const auto jitter = LogNormal::with_unit_mean(0.25);
  const auto unequal_row = [&](int replicas, const std::string& spec) {
    const auto speeds = replica_speeds(spec, replicas, o.seed + uint64_t(replicas));
    const auto r = simulate_unequal(speeds, 100, 50, o.outer_steps, jitter, o.late_bound * 50 * jitter.mean(),
                                    o.seed + uint64_t(replicas));
    for (const auto& [method, t] : {std::pair{"diloco", r.diloco}, std::pair{"noloco", r.noloco}}) {
      csv += fmt::format("{},\"{}\",{},today,{:.4f}\n", replicas, spec, method, t.today);
      csv += fmt::format("{},\"{}\",{},paced,{:.4f}\n", replicas, spec, method, t.paced);
    }
    return r;
  };
  unequal_row(8, "1,1,1,1,1,1,1,0.333");  // bench comm's straggler=3
  for (int replicas = 64; replicas <= o.max_replicas; replicas *= 4) {
    const auto r = unequal_row(replicas, o.speeds);
    headline[fmt::format("unequal_n{}_noloco_today", replicas)] = r.noloco.today;
    headline[fmt::format("unequal_n{}_noloco_paced", replicas)] = r.noloco.paced;
    headline[fmt::format("unequal_n{}_diloco_today", replicas)] = r.diloco.today;
    headline[fmt::format("unequal_n{}_diloco_paced", replicas)] = r.diloco.paced;
  }
  write_file_atomic(o.out + "/unequal.csv", csv);
}

}  // namespace

void validate(const SimulateOptions& o) {
  if (o.samples < 1 || o.outer_steps < 1 || o.max_replicas < 4 || !(o.step_seconds > 0) || !(o.late_bound >= 0))
    throw std::invalid_argument(
        "samples and outer_steps must be >= 1, max_replicas >= 4, step_seconds > 0, late_bound >= 0");
  model_preset(o.model);  // validates the name
  replica_speeds(o.speeds, 1, o.seed);  // validates the spec
}

nlohmann::json run_simulation(const SimulateOptions& o) {
  std::filesystem::create_directories(o.out);
  int sizes = 0, idle_sizes = 0;
  for (int n = 4; n <= o.max_replicas; n *= 4) ++sizes;
  for (int n = 2; n <= o.max_replicas; n *= 2) ++idle_sizes;
  Progress progress("simulate", sizes * 11 + 1 + 2 * idle_sizes);  // the unequal table is quick
  int64_t done = 0;
  nlohmann::json headline;

  // Latency (Fig. 5A): tree all-reduce over pair exchange, mean message time 1.
  std::string csv = "replicas,relative_std,tree_allreduce,pair_exchange,pair_closed_form,ratio\n";
  std::vector<PlotSeries> fig5a;
  int color = 0;
  for (int n = 4; n <= o.max_replicas; n *= 4) {
    PlotSeries s{fmt::format("N = {}", n), kColors[color++ % 6], false, {}};
    for (int i = 0; i <= 10; ++i) {
      const double x = 0.25 * i;
      const auto t = LogNormal::with_unit_mean(x);
      const double tree = simulate_tree_allreduce(n, t, o.samples, o.seed + uint64_t(i));
      const double pair = simulate_pair_exchange(t, o.samples * 4, o.seed + 1000 + uint64_t(i));
      csv += fmt::format("{},{},{:.6f},{:.6f},{:.6f},{:.6f}\n", n, x, tree, pair, pair_exchange_closed_form(t), tree / pair);
      s.points.emplace_back(x, tree / pair);
      if (n == 1024 && (i == 0 || i == 10)) headline[fmt::format("latency_ratio_n1024_std{}", x)] = tree / pair;
      progress.update(++done, fmt::format("latency, N = {}", n));
    }
    fig5a.push_back(s);
  }
  write_file_atomic(o.out + "/latency.csv", csv);
  write_file_atomic(o.out + "/fig5a.svg",
                    line_chart_svg(fig5a, {"Tree all-reduce time over NoLoCo pair exchange (Fig. 5A)",
                                           "std(t) / t_c of message times", "time ratio"}));

  // Bandwidth: one synchronisation of the model, and the share of wall-clock it takes.
  auto arch = model_preset(o.model);
  arch.vocab_size = 32000;
  const double bytes = 4.0 * double(arch.num_params());
  csv = "model,params,bandwidth_bits_per_s,rtt_s,replicas,method,variant,sync_seconds,comm_fraction\n";
  const int n = std::min(o.max_replicas, 64);
  for (double bits : {10e9, 1e9, 100e6}) {
    for (double rtt : {0.001, 0.05, 0.2}) {
      const Link link{bits / 8, rtt};
      struct Row {
        const char* method;
        const char* variant;
        double seconds;
        int per_steps;  // inner steps per synchronisation
      };
      const Row rows[] = {{"ddp", "ring", ring_allreduce_seconds(n, bytes, link), 1},
                          {"diloco", "ring", ring_allreduce_seconds(n, bytes, link), 100},
                          {"diloco", "tree", tree_allreduce_seconds(n, bytes, link), 100},
                          {"noloco", "fp32", noloco_exchange_seconds(bytes, link), 50},
                          {"noloco", "bf16", noloco_exchange_seconds(bytes / 2, link), 50}};
      for (const auto& r : rows) {
        const double fraction = r.seconds / (r.seconds + r.per_steps * o.step_seconds);
        csv += fmt::format("{},{},{},{},{},{},{},{:.6f},{:.6f}\n", o.model, arch.num_params(), bits, rtt, n, r.method,
                           r.variant, r.seconds, fraction);
      }
    }
  }
  write_file_atomic(o.out + "/bandwidth.csv", csv);
  progress.update(++done, "bandwidth");

  // Idle time (Fig. 5B): DiLoCo's global barrier against NoLoCo's pairwise waits.
  csv = "replicas,inner_steps,outer_steps,diloco_seconds,noloco_seconds,ratio\n";
  std::vector<PlotSeries> fig5b;
  const LogNormal step{1.0, std::sqrt(0.5)};
  color = 0;
  for (int h : {50, 100}) {
    PlotSeries s{fmt::format("H = {}", h), kColors[color++], false, {}};
    for (int replicas = 2; replicas <= o.max_replicas; replicas *= 2) {
      const auto r = simulate_idle(replicas, h, o.outer_steps, step, o.seed + uint64_t(replicas));
      csv += fmt::format("{},{},{},{:.3f},{:.3f},{:.6f}\n", replicas, h, o.outer_steps, r.diloco_seconds,
                         r.noloco_seconds, r.ratio());
      s.points.emplace_back(replicas, r.ratio());
      if (replicas == o.max_replicas) headline[fmt::format("idle_ratio_n{}_h{}", replicas, h)] = r.ratio();
      progress.update(++done, fmt::format("idle time, H = {}, N = {}", h, replicas));
    }
    fig5b.push_back(s);
  }
  write_file_atomic(o.out + "/idle.csv", csv);
  PlotOptions idle_plot{"Wall-clock of DiLoCo over NoLoCo with straggling steps (Fig. 5B)", "replicas",
                        "DiLoCo time / NoLoCo time"};
  idle_plot.log_x = true;
  write_file_atomic(o.out + "/fig5b.svg", line_chart_svg(fig5b, idle_plot));

  write_unequal_table(o, headline);
  write_json_atomic(run_files::in(o.out, run_files::kSummary), headline);
  return headline;
}

}  // namespace noloco::sim
