#include "train/bench_comm.h"

#include <chrono>
#include <cmath>
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <sstream>
#include <thread>
#include <tuple>

#include <fmt/format.h>

#include "util/files.h"
#include "util/parse_number.h"
#include "util/svg_plot.h"

namespace noloco {

namespace {
using Clock = std::chrono::steady_clock;
// A round's compute in as many inner steps, so that pace=speed can give a
// slower replica fewer of them.
constexpr int64_t kStepsPerRound = 10;
double since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// A model-sized flat buffer standing in for the weights.
struct Weights : torch::nn::Module {
  explicit Weights(int64_t n) { register_parameter("w", torch::randn({n})); }
};
}  // namespace

void validate(const CommBenchOptions& o) {
  if (o.rounds < 1 || !(o.megabytes > 0) || o.compute < 0 || o.sigma2 < 0 || !(o.straggler > 0))
    throw std::invalid_argument("bench comm needs rounds >= 1, megabytes > 0, compute >= 0, sigma2 >= 0, straggler > 0");
}

nlohmann::json comm_bench_worker(const TrainConfig& c, const CommBenchOptions& o, ReplicaPeers links) {
  torch::manual_seed(c.run.seed + uint64_t(links.transport->rank()));
  Weights weights(std::max<int64_t>(1, int64_t(o.megabytes * 1e6 / 4)));
  FlatParams flat(weights);
  auto every_round = c.outer;
  every_round.interval = kStepsPerRound;  // each round is one outer step
  const auto method = make_outer_optimizer(every_round, c.run.seed, links, flat);
  Pace* const pace = method->pace();
  const int rank = links.transport->rank();
  std::mt19937_64 rng(c.run.seed * 1000003 + uint64_t(rank));
  std::lognormal_distribution<double> jitter(-o.sigma2 / 2, std::sqrt(o.sigma2));  // mean 1
  double sync = 0, compute = 0;
  int64_t trained = 0;
  const auto start = Clock::now();
  for (int round = 0; round < o.rounds; ++round) {
    const double step_seconds = o.compute * jitter(rng) * (rank == 0 ? o.straggler : 1.0) / kStepsPerRound;
    for (int64_t slot = 0; slot < kStepsPerRound; ++slot) {
      const int64_t step = round * kStepsPerRound + slot;
      if (!pace || pace->trains_at(step)) {
        if (step_seconds > 0) std::this_thread::sleep_for(std::chrono::duration<double>(step_seconds));
        compute += step_seconds;
        ++trained;
        if (pace) pace->step_took(step_seconds);
      }
      if (slot + 1 < kStepsPerRound) continue;
      flat.values().add_(torch::randn_like(flat.values()), 1e-3);  // progress since the last outer step
      const auto t0 = Clock::now();
      if (c.outer.method == Method::ddp) {
        method->on_gradients(flat);
      } else {
        method->after_inner_step(step, flat);
      }
      sync += since(t0);
    }
  }
  const auto t0 = Clock::now();
  method->finish(flat);  // overlap: the last exchange, still in flight
  sync += since(t0);
  const double wall = since(start);
  nlohmann::json j = {{"rank", rank},
                      {"sync_seconds_per_round", sync / o.rounds},
                      {"idle_seconds_per_round", (wall - compute) / o.rounds},
                      {"wall_seconds", wall},
                      {"trained_steps", trained},
                      {"bytes_sent", links.transport->stats().bytes_sent}};
  // Its own pace: steps a second if it never waited (the jitter's mean is 1).
  if (o.compute > 0) j["ideal_steps_per_second"] = kStepsPerRound / (o.compute * (rank == 0 ? o.straggler : 1.0));
  return j;
}

namespace {

const std::vector<std::string> kColumns = {
    "method",  "replicas", "megabytes", "rounds", "compute", "sigma2", "wire_dtype", "sync_seconds_per_round",
    "idle_seconds_per_round", "wall_seconds", "straggler", "median_idle_seconds_others", "rate",
    "bytes_sent_per_round", "ideal_sync_seconds", "pace", "work_fraction"};

std::string csv_header() {
  std::string h;
  for (const auto& c : kColumns) h += (h.empty() ? "" : ",") + c;
  return h;
}

// All-reduce methods over NoLoCo, per replica count, from every row measured
// so far: sync time without compute and idle time with jittered compute (the
// shapes of the simulator's Fig. 5A and 5B), one line per link rate and codec.
void plot_comm_bench(const std::string& csv, const std::string& svg) {
  // (jittered, rate, wire) -> replicas -> method -> seconds per round
  std::map<std::tuple<bool, std::string, std::string>, std::map<int, std::map<std::string, double>>> seconds;
  std::ifstream in(csv);
  std::string line;
  std::getline(in, line);  // header
  auto column = [](const std::string& name) {
    return size_t(std::find(kColumns.begin(), kColumns.end(), name) - kColumns.begin());
  };
  while (std::getline(in, line)) {
    std::vector<std::string> cells;
    std::stringstream row(line);
    for (std::string cell; std::getline(row, cell, ',');) cells.push_back(cell);
    if (cells.size() != kColumns.size() || std::stod(cells[column("straggler")]) != 1.0 ||
        cells[column("pace")] != "steps")
      continue;
    const bool jittered = std::stod(cells[column("compute")]) > 0;
    const std::string method = parse_choice<Method>("method", cells[0]) == Method::noloco ? "noloco" : "allreduce";
    seconds[{jittered, cells[column("rate")], cells[column("wire_dtype")]}][std::stoi(cells[column("replicas")])]
           [method] = std::stod(cells[column(jittered ? "idle_seconds_per_round" : "sync_seconds_per_round")]);
  }
  const char* colors[] = {"#1f77b4", "#2ca02c", "#ff7f0e", "#d62728", "#9467bd", "#8c564b", "#17becf"};
  std::vector<PlotSeries> series;
  for (auto& [key, by_n] : seconds) {
    const auto& [jittered, rate, wire] = key;
    PlotSeries s{fmt::format("{}, {}, {}", jittered ? "idle, jittered compute" : "sync, no compute",
                             rate.empty() ? "loopback" : rate, wire),
                 colors[series.size() % 7], jittered, {}};
    for (auto& [n, by_method] : by_n)
      if (by_method.count("noloco") && by_method.count("allreduce"))
        s.points.emplace_back(n, by_method["allreduce"] / by_method["noloco"]);
    if (!s.points.empty()) series.push_back(s);
  }
  PlotOptions o{"Measured: all-reduce methods over NoLoCo (bench comm)", "replicas", "time ratio"};
  o.log_x = true;
  write_file_atomic(svg, line_chart_svg(series, o));
}

}  // namespace

nlohmann::json summarize_comm_bench(const TrainConfig& c, const CommBenchOptions& o) {
  double sync = 0, idle = 0, wall = 0, bytes = 0, work = 0, ideal_work = 0;
  std::vector<double> others_idle;  // everyone but worker 0, the straggler when there is one
  for (int r = 0; r < c.run.replicas; ++r) {
    const auto j = read_json(fmt::format("{}/bench_comm_r{}.json", c.run.out, r));
    sync += j["sync_seconds_per_round"].get<double>();
    idle += j["idle_seconds_per_round"].get<double>();
    wall = std::max(wall, j["wall_seconds"].get<double>());
    bytes += j["bytes_sent"].get<double>() / double(o.rounds);
    if (r > 0) others_idle.push_back(j["idle_seconds_per_round"].get<double>());
    work += j["trained_steps"].get<double>() / j["wall_seconds"].get<double>();
    ideal_work += j.value("ideal_steps_per_second", 0.0);
  }
  // The steps done a second by all replicas over the sum of their own paces (0: no compute to pace).
  const double work_fraction = ideal_work > 0 ? work / ideal_work : 0.0;
  std::sort(others_idle.begin(), others_idle.end());
  const double replicas = double(c.run.replicas);
  const double median_others = others_idle.empty() ? 0 : others_idle[others_idle.size() / 2];
  // Every replica's upload and download are capped: the round cannot end before
  // the bytes it sends have crossed its own link.
  const double bytes_per_round = bytes / replicas;
  const double ideal = c.comm.rate.empty() ? 0.0 : 8 * bytes_per_round / parse_bit_rate("rate", c.comm.rate);
  nlohmann::json s = {{"method", choice_name(c.outer.method)},
                      {"replicas", c.run.replicas},
                      {"megabytes", o.megabytes},
                      {"rounds", o.rounds},
                      {"compute", o.compute},
                      {"sigma2", o.sigma2},
                      {"wire_dtype", choice_name(c.outer.wire_dtype)},
                      {"sync_seconds_per_round", sync / replicas},
                      {"idle_seconds_per_round", idle / replicas},
                      {"wall_seconds", wall},
                      {"straggler", o.straggler},
                      {"median_idle_seconds_others", median_others},
                      {"rate", c.comm.rate},
                      {"bytes_sent_per_round", bytes_per_round},
                      {"ideal_sync_seconds", ideal},
                     {"pace", choice_name(c.outer.pace)},
                     {"work_fraction", work_fraction}};
  const std::string csv = c.run.out + "/bench_comm.csv";
  if (std::filesystem::exists(csv)) {
    std::ifstream existing(csv);
    std::string header;
    std::getline(existing, header);
    if (header != csv_header())
      throw std::runtime_error(fmt::format("{} has other columns (an older version wrote it); move it away", csv));
  } else {
    write_file_atomic(csv, csv_header() + "\n");
  }
  std::ofstream f(csv, std::ios::app);
  f << fmt::format("{},{},{},{},{},{},{},{:.6f},{:.6f},{:.3f},{},{:.6f},{},{:.0f},{:.6f},{},{:.4f}\n",
                   choice_name(c.outer.method), c.run.replicas, o.megabytes, o.rounds, o.compute, o.sigma2,
                   choice_name(c.outer.wire_dtype), sync / replicas, idle / replicas, wall, o.straggler, median_others,
                   c.comm.rate, bytes_per_round, ideal, choice_name(c.outer.pace), work_fraction);
  f.close();
  plot_comm_bench(csv, c.run.out + "/bench_comm.svg");
  return s;
}

}  // namespace noloco
