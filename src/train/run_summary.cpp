#include "train/run_summary.h"

#include <algorithm>
#include <numeric>
#include <cmath>
#include <filesystem>
#include <tuple>
#include <type_traits>
#include <variant>

#include <fmt/format.h>

#include "config/run_layout.h"
#include "train/model_choice.h"
#include "util/human.h"
#include "util/files.h"
#include "util/run_files.h"

namespace noloco {

namespace {

template <class T>
void put(nlohmann::json& j, const char* key, const std::optional<T>& v) {
  if (v) j[key] = *v;
}

template <class T>
std::optional<T> optional_of(const nlohmann::json& j, const char* key) {
  const auto it = j.find(key);
  if (it == j.end() || it->is_null()) return std::nullopt;
  return it->get<T>();
}

nlohmann::json worker_json(const RunSummary::Worker& w) {
  nlohmann::json j = {{"reason", w.reason}, {"seconds", w.seconds}, {"replica", w.replica}};
  put(j, "worker", w.worker);
  put(j, "stage", w.stage);
  return j;
}

RunSummary::Worker worker_of(const nlohmann::json& j) {
  return {j.value("replica", 0), optional_of<int>(j, "worker"), optional_of<int>(j, "stage"), j.value("reason", ""),
          j.value("seconds", 0.0)};
}

// How the workers' values of a figure become the run's.
enum class Combine {
  mean,  // over the finished workers that report it
  max,   // the largest of any finished worker
  min,   // the smallest
  sum,   // over the finished workers
  any,   // the same on every worker that reports it
};

// The figures a worker reports as optional numbers: their JSON names in the
// worker's summary and (if the run reports it) in the run's, and how they
// combine. A new figure is a field in each struct and a row here.
struct Figure {
  const char* worker_key;
  std::optional<double> WorkerSummary::*worker;
  const char* run_key;  // null: the run reports no such figure, or derives it itself
  std::optional<double> RunSummary::*run;
  Combine combine;
};
constexpr Figure kFigures[] = {
    {"final_val_loss", &WorkerSummary::final_val_loss, nullptr, nullptr, Combine::mean},
    {"final_train_loss", &WorkerSummary::final_train_loss, nullptr, nullptr, Combine::mean},
    {"weight_std", &WorkerSummary::weight_std, nullptr, nullptr, Combine::any},
    {"final_val_loss_mean_model", &WorkerSummary::final_val_loss_mean_model, "final_val_loss_mean_model",
     &RunSummary::final_val_loss_mean_model, Combine::any},
    {"bits_per_param_per_outer_step", &WorkerSummary::bits_per_param_per_outer_step, "bits_per_param_per_outer_step",
     &RunSummary::bits_per_param_per_outer_step, Combine::mean},
    {"bits_per_param_per_inner_step", &WorkerSummary::bits_per_param_per_inner_step, "bits_per_param_per_inner_step",
     &RunSummary::bits_per_param_per_inner_step, Combine::mean},
    {"steps_per_outer_step", &WorkerSummary::steps_per_outer_step, "steps_per_outer_step",
     &RunSummary::steps_per_outer_step, Combine::any},
    {"dropped_fraction", &WorkerSummary::dropped_fraction, "dropped_fraction", &RunSummary::dropped_fraction,
     Combine::mean},
    {"dropped_fraction_worst_outer_step", &WorkerSummary::dropped_fraction_worst_outer_step,
     "dropped_fraction_worst_outer_step", &RunSummary::dropped_fraction_worst_outer_step, Combine::max},
    {"outer_blocked_seconds", &WorkerSummary::outer_blocked_seconds, "outer_blocked_seconds_per_replica",
     &RunSummary::outer_blocked_seconds_per_replica, Combine::mean},
    {"trained_steps_per_second", &WorkerSummary::trained_steps_per_second, nullptr, nullptr, Combine::mean},
    {"trained_steps_per_outer_step", &WorkerSummary::trained_steps_per_outer_step, nullptr, nullptr, Combine::mean},
    {"peak_rss_mib", &WorkerSummary::peak_rss_mib, "worker_peak_rss_mib", &RunSummary::worker_peak_rss_mib,
     Combine::max},
    {"startup_seconds", &WorkerSummary::startup_seconds, "worker_startup_seconds", &RunSummary::worker_startup_seconds,
     Combine::max},
    {"store_requests_per_outer_step", &WorkerSummary::store_requests_per_outer_step, "store_requests_per_outer_step",
     &RunSummary::store_requests_per_outer_step, Combine::mean},
    {"store_kib_read_per_outer_step", &WorkerSummary::store_kib_read_per_outer_step, "store_kib_read_per_outer_step",
     &RunSummary::store_kib_read_per_outer_step, Combine::mean},
    {"spread_replicas", &WorkerSummary::spread_replicas, "spread_replicas", &RunSummary::spread_replicas, Combine::any},
    {"live_replicas", &WorkerSummary::live_replicas, "live_replicas", &RunSummary::live_replicas, Combine::any},
    {"paired_fraction", &WorkerSummary::paired_fraction, "paired_fraction_worst", &RunSummary::paired_fraction_worst,
     Combine::min},
    {"longest_alone_outer_steps", &WorkerSummary::longest_alone_outer_steps, "longest_alone_outer_steps",
     &RunSummary::longest_alone_outer_steps, Combine::max},
    {"outer_steps_alone_without_store", &WorkerSummary::outer_steps_alone_without_store,
     "outer_steps_alone_without_store", &RunSummary::outer_steps_alone_without_store, Combine::max},
    {"handovers_served", &WorkerSummary::handovers_served, "handovers_served", &RunSummary::handovers_served,
     Combine::sum},
    {"handovers_abandoned", &WorkerSummary::handovers_abandoned, "handovers_abandoned",
     &RunSummary::handovers_abandoned, Combine::sum},
};

// The run's figures of kFigures from its finished workers' summaries.
class FigureCombiner {
 public:
  void add(const WorkerSummary& w) {
    for (size_t i = 0; i < std::size(kFigures); ++i) {
      const auto& value = w.*kFigures[i].worker;
      if (!value) continue;
      auto& into = values_[i];
      switch (kFigures[i].combine) {
        case Combine::mean:
        case Combine::sum: into = into.value_or(0.0) + *value; break;
        case Combine::max: into = std::max(into.value_or(*value), *value); break;
        case Combine::min: into = std::min(into.value_or(*value), *value); break;
        case Combine::any: into = *value; break;
      }
      counts_[i] += 1;
    }
  }
  void write_to(RunSummary& run) const {
    for (size_t i = 0; i < std::size(kFigures); ++i) {
      if (!kFigures[i].run || !values_[i]) continue;
      run.*kFigures[i].run = kFigures[i].combine == Combine::mean ? *values_[i] / counts_[i] : *values_[i];
    }
  }

 private:
  std::optional<double> values_[std::size(kFigures)];
  double counts_[std::size(kFigures)] = {};
};


// The traffic counters a worker's metrics records and summary carry, each
// once: its JSON name and its field. A new counter is its field and a row.
template <class Stats>
struct Counter {
  const char* key;
  std::variant<uint64_t Stats::*, int64_t Stats::*, double Stats::*> field;
};
constexpr Counter<CommStats> kCommCounters[] = {
    {"bytes_sent", &CommStats::bytes_sent},     {"bytes_received", &CommStats::bytes_received},
    {"comm_seconds", &CommStats::comm_seconds}, {"wait_seconds", &CommStats::wait_seconds},
    {"collectives", &CommStats::collectives},   {"messages", &CommStats::messages},
    {"bytes_relayed", &CommStats::bytes_relayed}, {"bytes_punched", &CommStats::bytes_punched},
};
constexpr Counter<PipelineStats> kPipelineCounters[] = {
    {"activation_bytes_sent", &PipelineStats::bytes_sent},
    {"activation_bytes_received", &PipelineStats::bytes_received},
    {"activation_bytes_relayed", &PipelineStats::bytes_relayed},
    {"activation_bytes_punched", &PipelineStats::bytes_punched},
    {"pipeline_idle_seconds", &PipelineStats::idle_seconds},
    {"peak_micro_batches_held", &PipelineStats::peak_micro_batches_held},
    {"micro_batches_dropped", &PipelineStats::micro_batches_dropped},
    {"pipeline_peers_lost", &PipelineStats::peers_lost},
};

template <class Stats, size_t N>
void put_counters(nlohmann::json& j, const Counter<Stats> (&counters)[N], const Stats& stats) {
  for (const auto& c : counters) std::visit([&](auto field) { j[c.key] = stats.*field; }, c.field);
}

// The counters, if the record holds the first (the group is reported whole or not at all).
template <class Stats, size_t N>
std::optional<Stats> counters_of(const nlohmann::json& j, const Counter<Stats> (&counters)[N]) {
  if (!j.contains(counters[0].key)) return std::nullopt;
  Stats stats;
  for (const auto& c : counters)
    std::visit(
        [&](auto field) {
          using Value = std::decay_t<decltype(stats.*field)>;
          stats.*field = j.value(c.key, Value(0));
        },
        c.field);
  return stats;
}

}  // namespace

void WorkerTraffic::add_to(nlohmann::json& j) const {
  j["replica"] = replica;
  if (comm) put_counters(j, kCommCounters, *comm);
  if (pipeline) {
    j.update({{"worker", worker}, {"stage", stage}});
    put_counters(j, kPipelineCounters, *pipeline);
  }
}

WorkerTraffic WorkerTraffic::from_json(const nlohmann::json& j) {
  WorkerTraffic t;
  t.replica = j.value("replica", 0);
  t.worker = j.value("worker", t.replica);
  t.stage = j.value("stage", 0);
  t.comm = counters_of(j, kCommCounters);
  t.pipeline = counters_of(j, kPipelineCounters);
  return t;
}

std::string worker_summary_path(const std::string& run_dir, const RunLayout& layout, int rank) {
  const int replica = layout.replica_of(rank);
  return run_files::replica_summary(run_dir, replica, layout.stages() > 1 ? layout.stage_of(rank) : -1);
}

nlohmann::json WorkerSummary::to_json() const {
  nlohmann::json j = {{"method", choice_name(method)}, {"replicas", replicas}, {"steps", steps},   {"tokens", tokens},
                      {"seconds", seconds}, {"params", params},     {"device", device}};
  traffic.add_to(j);
  j["replica"] = replica;
  if (stages > 1) j.update({{"stages", stages}, {"stage", stage}, {"routing", routing}, {"stage_params", stage_params}});
  for (const auto& f : kFigures) put(j, f.worker_key, this->*f.worker);
  if (rejoin)
    j.update({{"rejoined_at_step", rejoin->step}, {"rejoin_donor", rejoin->donor}, {"rejoin_seconds", rejoin->seconds},
              {"joined", rejoin->joined}});
  if (left_at_step) j["left_at_step"] = *left_at_step;
  if (store_outages > 0) j.update({{"store_outages", store_outages}, {"store_outage_seconds", store_outage_seconds}});
  if (!store_gone.empty()) j["store_gone"] = store_gone;
  if (!refused_as_diverged.empty()) j["refused_as_diverged"] = refused_as_diverged;
  if (!renewed_at_steps.empty()) j["renewed_at_steps"] = renewed_at_steps;
  if (!relays_used.empty()) j["relays_used"] = relays_used;
  for (const auto& [peer, route] : routes) j["routes"][std::to_string(peer)] = route;
  for (const auto& w : workers)
    j["workers"].push_back({{"worker", w.worker},
                            {"device", w.device},
                            {"peak_rss_mib", w.peak_rss_mib},
                            {"startup_seconds", w.startup_seconds}});
  return j;
}

WorkerSummary WorkerSummary::from_json(const nlohmann::json& j) {
  WorkerSummary s;
  s.method = parse_choice<Method>("method", j.value("method", "none"));
  s.device = j.value("device", "");
  s.routing = j.value("routing", "");
  s.replicas = j.value("replicas", int64_t(1));
  s.stages = j.value("stages", int64_t(1));
  s.replica = j.value("replica", int64_t(0));
  s.stage = j.value("stage", int64_t(0));
  s.steps = j.value("steps", int64_t(0));
  s.tokens = j.value("tokens", int64_t(0));
  s.params = j.value("params", int64_t(0));
  s.stage_params = j.value("stage_params", s.params);
  s.seconds = j.value("seconds", 0.0);
  s.traffic = WorkerTraffic::from_json(j);
  for (const auto& f : kFigures) s.*f.worker = optional_of<double>(j, f.worker_key);
  if (j.contains("rejoined_at_step"))
    s.rejoin = WorkerSummary::Rejoin{j["rejoined_at_step"].get<int64_t>(), j.value("rejoin_donor", 0),
                                     j.value("rejoin_seconds", 0.0), j.value("joined", false)};
  s.left_at_step = optional_of<int64_t>(j, "left_at_step");
  s.store_outages = j.value("store_outages", int64_t(0));
  s.store_outage_seconds = j.value("store_outage_seconds", 0.0);
  s.store_gone = j.value("store_gone", "");
  s.refused_as_diverged = j.value("refused_as_diverged", std::vector<int>{});
  s.renewed_at_steps = j.value("renewed_at_steps", std::vector<int64_t>{});
  s.relays_used = j.value("relays_used", std::vector<std::string>{});
  const auto routes = j.value("routes", nlohmann::json::object());
  for (const auto& [peer, route] : routes.items()) s.routes[std::stoi(peer)] = route.get<std::string>();
  for (const auto& w : j.value("workers", nlohmann::json::array()))
    s.workers.push_back({w.value("worker", 0), w.value("device", ""), w.value("peak_rss_mib", 0.0),
                         w.value("startup_seconds", 0.0)});
  return s;
}

nlohmann::json RunSummary::to_json() const {
  nlohmann::json failed_j = nlohmann::json::array(), restarted_j = nlohmann::json::array(),
                 left_j = nlohmann::json::array();
  for (const auto& w : failed) failed_j.push_back(worker_json(w));
  for (const auto& w : restarted) restarted_j.push_back(worker_json(w));
  for (const auto& w : left) left_j.push_back(worker_json(w));
  nlohmann::json joined_j = nlohmann::json::array();
  for (const auto& w : joined) {
    nlohmann::json one = {{"replica", w.replica}};
    put(one, "step", w.step);
    put(one, "donor", w.donor);
    put(one, "handover_seconds", w.handover_seconds);
    joined_j.push_back(one);
  }
  nlohmann::json j = {{"method", choice_name(method)},
                      {"replicas", replicas},
                      {"replicas_finished", finished},
                      {"replicas_failed", failed_j},
                      {"replicas_restarted", restarted_j},
                      {"replicas_left", left_j},
                      {"joined", joined_j},
                      {"final_val_loss", final_val_loss ? nlohmann::json(*final_val_loss) : nlohmann::json()},
                      {"final_val_loss_replicas", final_val_loss_replicas},
                      {"steps_per_second_replicas", steps_per_second_replicas},
                      {"steps_per_outer_step_replicas", steps_per_outer_step_replicas},
                      {"outer_blocked_seconds_replicas", outer_blocked_seconds_replicas},
                      {"bytes_sent", bytes_sent},
                      {"bytes_received", bytes_received},
                      {"bytes_relayed", bytes_relayed},
                      {"bytes_punched", bytes_punched},
                      {"comm_seconds", comm_seconds},
                      {"wait_seconds", wait_seconds},
                      {"comm_seconds_per_replica", comm_seconds_per_replica},
                      {"wait_seconds_per_replica", wait_seconds_per_replica},
                      {"collectives", collectives},
                      {"tokens", tokens},
                      {"seconds", seconds},
                      {"steps", steps},
                      {"params", params}};
  put(j, "weight_std", weight_std);
  put(j, "best_replica", best_replica);
  put(j, "final_val_loss_best_replica", final_val_loss_best_replica);
  if (!handed_over.empty()) j["handed_over"] = handed_over;
  for (const auto& f : kFigures)
    if (f.run) put(j, f.run_key, this->*f.run);
  if (!replicas_mostly_alone.empty()) j["replicas_mostly_alone"] = replicas_mostly_alone;
  if (!replicas_refused_as_diverged.empty()) j["replicas_refused_as_diverged"] = replicas_refused_as_diverged;
  if (!replicas_renewed.empty()) j["replicas_renewed"] = replicas_renewed;
  for (const auto& w : workers_finished) j["workers_finished"].push_back(worker_json(w));
  if (stages > 1)
    j.update({{"stages", stages},
              {"routing", routing},
              {"activation_codec", activation_codec},
              {"activation_grad_codec", activation_grad_codec},
              {"activation_rotation", activation_rotation},
              {"micro_batches", micro_batches},
              {"activation_bytes_sent", activation_bytes_sent},
              {"activation_bytes_relayed", activation_bytes_relayed},
              {"activation_bytes_punched", activation_bytes_punched},
              {"activation_bytes_per_step", activation_bytes_per_step},
              {"activation_subspace", activation_subspace},
              {"activation_bits_per_value", activation_bits_per_value},
              {"pipeline_idle_seconds_per_stage", pipeline_idle_seconds_per_stage},
              {"micro_batches_dropped", micro_batches_dropped}});
  return j;
}

RunSummary RunSummary::from_json(const nlohmann::json& j) {
  RunSummary s;
  s.method = parse_choice<Method>("method", j.value("method", "none"));
  s.replicas = j.value("replicas", int64_t(1));
  s.steps = j.value("steps", int64_t(0));
  s.params = j.value("params", int64_t(0));
  s.tokens = j.value("tokens", int64_t(0));
  s.collectives = j.value("collectives", int64_t(0));
  s.finished = j.value("replicas_finished", std::vector<int>{});
  for (const auto& w : j.value("replicas_failed", nlohmann::json::array())) s.failed.push_back(worker_of(w));
  for (const auto& w : j.value("replicas_restarted", nlohmann::json::array())) s.restarted.push_back(worker_of(w));
  for (const auto& w : j.value("replicas_left", nlohmann::json::array())) s.left.push_back(worker_of(w));
  for (const auto& w : j.value("workers_finished", nlohmann::json::array())) s.workers_finished.push_back(worker_of(w));
  for (const auto& w : j.value("joined", nlohmann::json::array()))
    s.joined.push_back({w.value("replica", 0), optional_of<int64_t>(w, "step"), optional_of<int>(w, "donor"),
                        optional_of<double>(w, "handover_seconds")});
  s.final_val_loss = optional_of<double>(j, "final_val_loss");
  s.weight_std = optional_of<double>(j, "weight_std");
  s.best_replica = optional_of<int>(j, "best_replica");
  s.final_val_loss_best_replica = optional_of<double>(j, "final_val_loss_best_replica");
  s.handed_over = j.value("handed_over", "");
  for (const auto& f : kFigures)
    if (f.run) s.*f.run = optional_of<double>(j, f.run_key);
  s.replicas_mostly_alone = j.value("replicas_mostly_alone", std::vector<int>{});
  s.replicas_refused_as_diverged = j.value("replicas_refused_as_diverged", std::vector<int>{});
  s.replicas_renewed = j.value("replicas_renewed", std::vector<int>{});
  s.final_val_loss_replicas = j.value("final_val_loss_replicas", std::vector<double>{});
  s.steps_per_second_replicas = j.value("steps_per_second_replicas", std::vector<double>{});
  s.steps_per_outer_step_replicas = j.value("steps_per_outer_step_replicas", std::vector<double>{});
  s.outer_blocked_seconds_replicas = j.value("outer_blocked_seconds_replicas", std::vector<double>{});
  s.bytes_sent = j.value("bytes_sent", uint64_t(0));
  s.bytes_received = j.value("bytes_received", uint64_t(0));
  s.bytes_relayed = j.value("bytes_relayed", uint64_t(0));
  s.bytes_punched = j.value("bytes_punched", uint64_t(0));
  s.comm_seconds = j.value("comm_seconds", 0.0);
  s.wait_seconds = j.value("wait_seconds", 0.0);
  s.comm_seconds_per_replica = j.value("comm_seconds_per_replica", 0.0);
  s.wait_seconds_per_replica = j.value("wait_seconds_per_replica", 0.0);
  s.seconds = j.value("seconds", 0.0);
  s.stages = j.value("stages", int64_t(1));
  s.micro_batches = j.value("micro_batches", int64_t(1));
  s.routing = j.value("routing", "");
  s.activation_codec = j.value("activation_codec", "fp32");
  s.activation_grad_codec = j.value("activation_grad_codec", "fp32");
  s.activation_rotation = j.value("activation_rotation", false);
  s.activation_bytes_sent = j.value("activation_bytes_sent", uint64_t(0));
  s.activation_bytes_relayed = j.value("activation_bytes_relayed", uint64_t(0));
  s.activation_bytes_punched = j.value("activation_bytes_punched", uint64_t(0));
  s.activation_bytes_per_step = j.value("activation_bytes_per_step", 0.0);
  s.activation_subspace = j.value("activation_subspace", int64_t(0));
  s.activation_bits_per_value = j.value("activation_bits_per_value", 0.0);
  s.pipeline_idle_seconds_per_stage = j.value("pipeline_idle_seconds_per_stage", std::vector<double>{});
  s.micro_batches_dropped = j.value("micro_batches_dropped", int64_t(0));
  return s;
}

RunSummary RunSummary::read(const std::string& run_dir) {
  try {
    return from_json(read_json(run_files::in(run_dir, run_files::kSummary)));
  } catch (const nlohmann::json::exception& e) {
    throw std::runtime_error(fmt::format("{}/summary.json: {}", run_dir, e.what()));
  } catch (const std::invalid_argument& e) {
    throw std::runtime_error(fmt::format("{}/summary.json: {}", run_dir, e.what()));
  }
}

double spread_over_stages(const std::vector<std::pair<double, double>>& stages) {
  double var_sum = 0, params = 0;
  for (const auto& [n, std_dev] : stages) {
    var_sum += n * std_dev * std_dev;
    params += n;
  }
  return params > 0 ? std::sqrt(var_sum / params) : std::nan("");
}

RunSummary summarize_lone_run(const WorkerSummary& w) {
  RunSummary s;
  s.method = w.method;
  s.replicas = w.replicas;
  s.finished = {0};
  s.final_val_loss = w.final_val_loss;
  if (w.final_val_loss) s.final_val_loss_replicas = {*w.final_val_loss};
  s.tokens = w.tokens;
  s.seconds = w.seconds;
  s.steps = w.steps;
  s.params = w.params;
  FigureCombiner figures;
  figures.add(w);
  figures.write_to(s);
  return s;
}

namespace {

// Where exit `e` sat in the run, and how it ended.
RunSummary::Worker place_of(const WorkerExit& e, const RunLayout& layout) {
  RunSummary::Worker where{layout.replica_of(e.rank), std::nullopt, std::nullopt, e.describe(), e.seconds};
  if (layout.stages() > 1) where.stage = layout.stage_of(e.rank);
  if (layout.workers_per_replica() > 1) where.worker = e.rank;
  return where;
}

// A finished worker's place, without the exit's description.
RunSummary::Worker finished_place(RunSummary::Worker where) {
  where.reason.clear();
  return where;
}

// What the run's figures gather from its workers' summaries.
struct RunTally {
  explicit RunTally(int64_t stages) : stage_spread(size_t(stages), {0.0, std::nan("")}), stage_idle(size_t(stages)) {}

  // Training traffic counts whoever sent it, also a worker that left early.
  void add_traffic(RunSummary& run, const WorkerSummary& w) {
    if (!w.traffic.comm) return;
    run.bytes_sent += w.traffic.comm->bytes_sent;
    run.bytes_received += w.traffic.comm->bytes_received;
    run.bytes_relayed += w.traffic.comm->bytes_relayed;
    run.bytes_punched += w.traffic.comm->bytes_punched;
    run.comm_seconds += w.traffic.comm->comm_seconds;
    run.wait_seconds += w.traffic.comm->wait_seconds;
    run.collectives += w.traffic.comm->collectives;
    ++traffic_workers;
  }

  void add_finished(RunSummary& run, const WorkerSummary& w, int member, int stage) {
    if (!first) first = w;
    if (w.final_val_loss) {  // the workers that compute the loss: one per replica
      run.final_val_loss_replicas.push_back(*w.final_val_loss);
      validated.replica_loss[int(w.replica)] = *w.final_val_loss;
      if (w.trained_steps_per_second) run.steps_per_second_replicas.push_back(*w.trained_steps_per_second);
      if (w.trained_steps_per_outer_step) run.steps_per_outer_step_replicas.push_back(*w.trained_steps_per_outer_step);
      if (w.outer_blocked_seconds) run.outer_blocked_seconds_replicas.push_back(*w.outer_blocked_seconds);
      loss_sum += *w.final_val_loss;
      run.tokens += w.tokens;
    }
    figures.add(w);
    if (w.paired_fraction && *w.paired_fraction < 1.0 - kMostlyAlone &&
        w.longest_alone_outer_steps.value_or(0.0) >= kAloneInARow)
      run.replicas_mostly_alone.push_back(member);
    if (w.traffic.pipeline) {
      run.activation_bytes_sent += w.traffic.pipeline->bytes_sent;
      run.activation_bytes_relayed += w.traffic.pipeline->bytes_relayed;
      run.activation_bytes_punched += w.traffic.pipeline->bytes_punched;
      run.micro_batches_dropped += w.traffic.pipeline->micro_batches_dropped;
    }
    auto& spread = stage_spread[size_t(stage)];
    if (w.weight_std && std::isnan(spread.second)) spread = {double(w.stage_params), *w.weight_std};
    stage_idle[size_t(stage)].push_back(w.traffic.pipeline ? w.traffic.pipeline->idle_seconds : 0.0);
  }

  // A worker that left trained all the same: its tokens count, and where no
  // replica finished, the leavers' steps, parameters and last evaluations
  // are what the run measured.
  void add_left(RunSummary& run, const WorkerSummary& w) {
    if (w.final_val_loss || w.final_train_loss) run.tokens += w.tokens;  // one a replica: those that compute the loss
    if (w.final_val_loss) left_losses.push_back(*w.final_val_loss);
    if (!furthest_left || w.steps > furthest_left->steps) furthest_left = w;
  }

  void write_to(RunSummary& run) const {
    const double workers = double(std::max(1, traffic_workers));
    if (!run.final_val_loss_replicas.empty())
      run.final_val_loss = loss_sum / double(run.final_val_loss_replicas.size());
    else if (!left_losses.empty())
      run.final_val_loss = std::accumulate(left_losses.begin(), left_losses.end(), 0.0) / double(left_losses.size());
    figures.write_to(run);
    write_handed_over(run);
    run.comm_seconds_per_replica = run.comm_seconds / workers;
    run.wait_seconds_per_replica = run.wait_seconds / workers;
    if (const auto& measured = first ? first : furthest_left) {
      run.steps = measured->steps;
      run.params = measured->params;
    }
    const double spread = spread_over_stages(stage_spread);
    if (!std::isnan(spread)) run.weight_std = spread;
    if (run.stages == 1) return;
    run.activation_bytes_per_step = run.steps > 0 ? double(run.activation_bytes_sent) / double(run.steps) : 0.0;
    for (const auto& per_replica : stage_idle) {
      double sum = 0;
      for (double x : per_replica) sum += x;
      run.pipeline_idle_seconds_per_stage.push_back(per_replica.empty() ? 0.0 : sum / double(per_replica.size()));
    }
  }

  // The model `export` takes by default, by the run's last validation.
  void write_handed_over(RunSummary& run) const {
    auto models = validated;
    models.mean_model_loss = run.final_val_loss_mean_model;
    if (const auto best = best_replica(models)) std::tie(run.best_replica, run.final_val_loss_best_replica) = *best;
    const auto choice = choose_model(models);
    run.handed_over = choice.replica ? fmt::format("replica {}", *choice.replica) : kMeanOfReplicas;
  }

  ValidatedModels validated;
  double loss_sum = 0;
  int traffic_workers = 0;
  std::optional<WorkerSummary> first, furthest_left;
  std::vector<double> left_losses;
  FigureCombiner figures;
  // Per stage: (parameters, weight std) of one of its replicas, and the replicas' idle seconds.
  std::vector<std::pair<double, double>> stage_spread;
  std::vector<std::vector<double>> stage_idle;
};

// Named once each, sorted.
void note_divergence(RunSummary& run, const WorkerSummary& w, int member) {
  auto add = [](std::vector<int>& to, int replica) {
    if (std::find(to.begin(), to.end(), replica) == to.end()) {
      to.push_back(replica);
      std::sort(to.begin(), to.end());
    }
  };
  for (int sender : w.refused_as_diverged) add(run.replicas_refused_as_diverged, sender);
  if (!w.renewed_at_steps.empty()) add(run.replicas_renewed, member);
}

}  // namespace

RunSummary summarize_run(const std::string& run_dir, Method method, int64_t replicas, int64_t stages,
                         const std::string& routing, int64_t micro_batches, const std::vector<WorkerExit>& exits,
                         double seconds, int64_t replica_workers) {
  RunSummary run;
  run.method = method;
  run.replicas = replicas;
  run.stages = stages;
  run.seconds = seconds;
  if (stages > 1) {
    run.routing = routing;
    run.micro_batches = micro_batches;
  }
  RunTally tally(stages);
  const RunLayout layout{int(stages), int(replica_workers)};
  for (const auto& e : exits) {
    auto where = place_of(e, layout);
    if (e.restarted) {  // its next start decides whether it finished
      run.restarted.push_back(where);
      continue;
    }
    const int member = layout.unit_of(e.rank);
    const auto path = worker_summary_path(run_dir, layout, e.rank);
    if (e.joined && e.ok() && !std::filesystem::exists(path)) {
      // It finished (the store says so) and wrote its summary where it ran: another machine.
      run.joined.push_back({member, std::nullopt, std::nullopt, std::nullopt});
      run.finished.push_back(member);
      if (stages > 1) run.workers_finished.push_back(finished_place(where));
      continue;
    }
    if (!e.ok() || !std::filesystem::exists(path)) {
      // A joiner that died after it joined was a member all the same.
      if (e.joined) run.joined.push_back({member, std::nullopt, std::nullopt, std::nullopt});
      run.failed.push_back(where);
      continue;
    }
    if (layout.speaker_of(e.rank) != e.rank) continue;  // its replica's first worker speaks for it
    const auto w = WorkerSummary::from_json(read_json(path));
    if (w.rejoin && w.rejoin->joined) run.joined.push_back({member, w.rejoin->step, w.rejoin->donor, w.rejoin->seconds});
    tally.add_traffic(run, w);
    note_divergence(run, w, member);
    if (w.left_at_step) {
      where.reason = w.store_gone.empty() ? fmt::format("left after step {} (SIGTERM)", *w.left_at_step)
                                          : fmt::format("ended after step {}: {}", *w.left_at_step, w.store_gone);
      run.left.push_back(where);
      tally.add_left(run, w);
      continue;
    }
    run.finished.push_back(member);
    if (stages > 1) run.workers_finished.push_back(finished_place(where));
    tally.add_finished(run, w, member, layout.stage_of(e.rank));
  }
  // Workers are heard from stage by stage (a serve's worker 0 asks each stage's members in turn).
  std::sort(run.finished.begin(), run.finished.end());
  const auto by_worker = [](const RunSummary::Worker& a, const RunSummary::Worker& b) {
    return std::make_pair(a.replica, a.stage.value_or(0)) < std::make_pair(b.replica, b.stage.value_or(0));
  };
  std::sort(run.workers_finished.begin(), run.workers_finished.end(), by_worker);
  tally.write_to(run);
  return run;
}

namespace {

// Each run directory's name and summary, read once for every table.
std::vector<std::pair<std::string, RunSummary>> read_summaries(const std::vector<std::string>& run_dirs) {
  std::vector<std::pair<std::string, RunSummary>> runs;
  for (const auto& dir : run_dirs) runs.emplace_back(std::filesystem::path(dir).filename().string(), RunSummary::read(dir));
  return runs;
}

std::string pace_table_of(const std::vector<std::pair<std::string, RunSummary>>& runs) {
  const auto range = [](const std::vector<double>& v, const char* format) -> std::string {
    if (v.empty()) return "–";
    const auto [low, high] = std::minmax_element(v.begin(), v.end());
    return fmt::format(fmt::runtime(format), *low) + "–" + fmt::format(fmt::runtime(format), *high);
  };
  std::string rows;
  for (const auto& [name, s] : runs) {
    const auto& per_period = s.steps_per_outer_step_replicas;
    const auto [fewest, most] = std::minmax_element(per_period.begin(), per_period.end());
    if (per_period.empty() || *fewest == *most) continue;  // every replica trained every slot: nothing to show
    rows += fmt::format("| {} | {} | {} | {} |\n", name, range(s.steps_per_second_replicas, "{:.1f}"),
                        range(per_period, "{:.1f}"), range(s.outer_blocked_seconds_replicas, "{:.1f}"));
  }
  if (rows.empty()) return "";
  return "\nReplicas at their own pace (pace=speed), slowest to fastest:\n\n"
         "| run | trained steps/s | inner steps an outer step | waited at outer steps, s |\n|---|---|---|---|\n" +
         rows;
}

}  // namespace

std::string comparison_table(const std::vector<std::string>& run_dirs) {
  std::string t =
      "| run | method | replicas | final val loss | ppl | mean-model val loss | best replica val loss | export takes | "
      "weight std | training bytes | bits/param/inner step | comm s/replica | wait s/replica | collectives | wall s |\n"
      "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n";
  auto num = [](const std::optional<double>& v, const char* format) -> std::string {
    if (!v) return "–";
    return fmt::format(fmt::runtime(format), *v);
  };
  const auto runs = read_summaries(run_dirs);
  for (const auto& [name, s] : runs) {
    const double loss = s.final_val_loss.value_or(std::nan(""));
    const bool lone = s.replicas == 1 && s.stages == 1;
    const auto best = s.best_replica ? fmt::format("{} ({})", num(s.final_val_loss_best_replica, "{:.4f}"),
                                                   *s.best_replica)
                                     : "–";
    t += fmt::format("| {} | {} | {} | {} | {:.2f} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {:.0f} |\n", name,
                     choice_name(s.method), s.replicas, num(s.final_val_loss, "{:.4f}"), std::exp(loss),
                     num(s.final_val_loss_mean_model, "{:.4f}"), best, s.handed_over.empty() ? "–" : s.handed_over,
                     num(s.weight_std, "{:.2e}"), format_count(double(s.bytes_sent)),
                     num(s.bits_per_param_per_inner_step, "{:.3g}"),
                     lone ? "–" : fmt::format("{:.1f}", s.comm_seconds_per_replica),
                     lone ? "–" : fmt::format("{:.1f}", s.wait_seconds_per_replica), s.collectives, s.seconds);
  }
  return t + pace_table_of(runs);
}

std::string pace_table(const std::vector<std::string>& run_dirs) { return pace_table_of(read_summaries(run_dirs)); }

}  // namespace noloco
