#include "comm/bench_comm.h"

#include <chrono>
#include <cmath>
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <sstream>
#include <thread>

#include <fmt/format.h>

#include "optim/grouping.h"
#include "util/files.h"
#include "util/parse_number.h"
#include "util/svg_plot.h"

namespace noloco {

namespace {
using Clock = std::chrono::steady_clock;
double since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

double take_number(std::vector<std::string>& args, const std::string& key, double fallback) {
  for (auto it = args.begin(); it != args.end(); ++it) {
    if (it->rfind(key + "=", 0) != 0) continue;
    const double v = parse_non_negative(key, it->substr(key.size() + 1));
    args.erase(it);
    return v;
  }
  return fallback;
}
}  // namespace

CommBenchOptions parse_comm_bench_options(std::vector<std::string>& args) {
  CommBenchOptions o;
  o.megabytes = take_number(args, "megabytes", o.megabytes);
  o.rounds = int(take_number(args, "rounds", o.rounds));
  o.compute = take_number(args, "compute", o.compute);
  o.sigma2 = take_number(args, "sigma2", o.sigma2);
  o.straggler = take_number(args, "straggler", o.straggler);
  if (o.rounds < 1 || o.megabytes <= 0) throw std::invalid_argument("rounds must be >= 1 and megabytes > 0");
  return o;
}

nlohmann::json comm_bench_worker(const TrainConfig& c, const CommBenchOptions& o, Communicator& comm) {
  const int64_t numel = std::max<int64_t>(1, int64_t(o.megabytes * 1e6 / 4));
  auto theta = torch::randn({numel});
  std::vector<int> all(static_cast<size_t>(comm.world()));
  for (int r = 0; r < comm.world(); ++r) all[size_t(r)] = r;
  std::mt19937_64 rng(c.seed * 1000003 + uint64_t(comm.rank()));
  std::lognormal_distribution<double> jitter(-o.sigma2 / 2, std::sqrt(o.sigma2));  // mean 1
  double sync = 0, compute = 0;
  const auto start = Clock::now();
  for (int round = 0; round < o.rounds; ++round) {
    if (o.compute > 0) {
      const double seconds = o.compute * jitter(rng) * (comm.rank() == 0 ? o.straggler : 1.0);
      std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
      compute += seconds;
    }
    const auto t0 = Clock::now();
    if (c.method == "noloco") {
      const auto groups = noloco_groups(c.seed, round, all, int(c.group_size));
      for (const auto& g : groups)
        if (std::count(g.begin(), g.end(), comm.rank()))
          comm.group_mean(c.wire_dtype == "bf16" ? theta.to(torch::kBFloat16) : theta, g, round);
    } else {
      auto delta = theta.clone();
      comm.all_reduce_mean(delta);
    }
    sync += since(t0);
  }
  const double wall = since(start);
  return {{"rank", comm.rank()},
          {"sync_seconds_per_round", sync / o.rounds},
          {"idle_seconds_per_round", (wall - compute) / o.rounds},
          {"wall_seconds", wall},
          {"bytes_sent", comm.stats().bytes_sent}};
}

// All-reduce over NoLoCo, per replica count, from every row measured so far:
// sync time without compute, idle time with jittered compute (the shapes of
// the simulator's Fig. 5A and 5B).
static void plot_comm_bench(const std::string& csv, const std::string& svg) {
  std::map<std::pair<bool, int>, std::map<std::string, double>> seconds;  // (jittered, N) -> method -> s/round
  std::ifstream in(csv);
  std::string line;
  std::getline(in, line);  // header
  while (std::getline(in, line)) {
    std::vector<std::string> cells;
    std::stringstream row(line);
    for (std::string cell; std::getline(row, cell, ',');) cells.push_back(cell);
    if (cells.size() < 12 || std::stod(cells[10]) != 1.0) continue;  // straggler rows are plotted apart
    const bool jittered = std::stod(cells[4]) > 0;
    const std::string method = cells[0] == "noloco" ? "noloco" : "allreduce";
    seconds[{jittered, std::stoi(cells[1])}][method] = std::stod(cells[jittered ? 8 : 7]);
  }
  PlotSeries sync{"sync time, no compute", "#1f77b4", false, {}}, idle{"idle time, jittered compute", "#2ca02c", false, {}};
  for (auto& [key, by_method] : seconds) {
    if (!by_method.count("noloco") || !by_method.count("allreduce")) continue;
    (key.first ? idle : sync).points.emplace_back(key.second, by_method["allreduce"] / by_method["noloco"]);
  }
  PlotOptions o{"Measured: all-reduce methods over NoLoCo (bench comm)", "replicas", "time ratio"};
  o.log_x = true;
  write_file_atomic(svg, line_chart_svg({sync, idle}, o));
}

nlohmann::json summarize_comm_bench(const TrainConfig& c, const CommBenchOptions& o) {
  double sync = 0, idle = 0, wall = 0;
  std::vector<double> others_idle;  // everyone but worker 0, the straggler when there is one
  for (int r = 0; r < c.replicas; ++r) {
    const auto j = read_json(fmt::format("{}/bench_comm_r{}.json", c.out, r));
    sync += j["sync_seconds_per_round"].get<double>();
    idle += j["idle_seconds_per_round"].get<double>();
    wall = std::max(wall, j["wall_seconds"].get<double>());
    if (r > 0) others_idle.push_back(j["idle_seconds_per_round"].get<double>());
  }
  std::sort(others_idle.begin(), others_idle.end());
  const double median_others = others_idle.empty() ? 0 : others_idle[others_idle.size() / 2];
  nlohmann::json s = {{"method", c.method},        {"replicas", c.replicas},
                      {"megabytes", o.megabytes},  {"rounds", o.rounds},
                      {"compute", o.compute},      {"sigma2", o.sigma2},
                      {"wire_dtype", c.wire_dtype}, {"sync_seconds_per_round", sync / double(c.replicas)},
                      {"idle_seconds_per_round", idle / double(c.replicas)}, {"wall_seconds", wall},
                      {"straggler", o.straggler}, {"median_idle_seconds_others", median_others}};
  const std::string csv = c.out + "/bench_comm.csv";
  const bool fresh = !std::filesystem::exists(csv);
  std::ofstream f(csv, std::ios::app);
  if (fresh)
    f << "method,replicas,megabytes,rounds,compute,sigma2,wire_dtype,sync_seconds_per_round,idle_seconds_per_round,"
         "wall_seconds,straggler,median_idle_seconds_others\n";
  f << fmt::format("{},{},{},{},{},{},{},{:.6f},{:.6f},{:.3f},{},{:.6f}\n", c.method, c.replicas, o.megabytes, o.rounds,
                   o.compute, o.sigma2, c.wire_dtype, s["sync_seconds_per_round"].get<double>(),
                   s["idle_seconds_per_round"].get<double>(), wall, o.straggler, median_others);
  f.close();
  plot_comm_bench(csv, c.out + "/bench_comm.svg");
  return s;
}

}  // namespace noloco
