// What a run leaves behind: a summary per replica (summary_r<replica>.json;
// in a pipeline, per worker: summary_r<replica>_s<stage>.json) and summary.json
// for the run, written and read back through these structs (the report
// reads runs with the same code that wrote them); and the comparison table.
#pragma once
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "comm/transport/comm_stats.h"
#include "pipeline/pipeline_stats.h"
#include "comm/launch/launcher.h"
#include "config/choices.h"
#include "config/run_layout.h"

namespace noloco {

// Where the summary of the worker of `rank` (its replica's first at its stage) is in `run_dir`.
std::string worker_summary_path(const std::string& run_dir, const RunLayout& layout, int rank);

// Where a worker sits and what its traffic cost so far: the fields every
// metrics record and summary of the worker carries.
struct WorkerTraffic {
  int replica = 0, worker = 0, stage = 0;
  std::optional<CommStats> comm;          // with an outer method
  std::optional<PipelineStats> pipeline;  // with pipeline stages
  void add_to(nlohmann::json& j) const;
  static WorkerTraffic from_json(const nlohmann::json& j);
};

struct WorkerSummary {
  Method method = Method::none;
  std::string device, routing;
  int64_t replicas = 1, stages = 1, steps = 0, tokens = 0, params = 0, stage_params = 0;
  int64_t replica = 0, stage = 0;  // whose summary this is
  double seconds = 0;
  WorkerTraffic traffic;
  std::optional<double> final_val_loss, final_train_loss;  // on the workers that compute the loss
  std::optional<double> weight_std, final_val_loss_mean_model;
  // Training bytes this worker sent per synchronisation (outer step; a step
  // under ddp), in bits per parameter of its model or stage, and the steps
  // between two synchronisations (with fragments: interval/fragments).
  std::optional<double> bits_per_param_per_outer_step, steps_per_outer_step;
  // Every byte sent for training × 8 / (parameters × inner steps trained): the rate a link must carry.
  std::optional<double> bits_per_param_per_inner_step;
  // Of the values in peers' outer-step messages that arrived, the share it
  // could not use (rejected messages, φ blocks outside their grid), in all
  // and at its worst outer step.
  std::optional<double> dropped_fraction, dropped_fraction_worst_outer_step;
  // Seconds the outer steps held up training (with overlap: waits for an exchange still in flight).
  std::optional<double> outer_blocked_seconds;
  // Its own pace: inner steps trained a second of its training loop, and
  // between two outer steps (pace=speed: fewer than outer_interval on a slower machine).
  std::optional<double> trained_steps_per_second, trained_steps_per_outer_step;
  // Health of an exchanging method: the share of its outer steps with at
  // least one partner's message, the longest run of outer steps without; and
  // the state hand-overs it served to restarted or joining replicas, and
  // those abandoned because the receiver was gone.
  std::optional<double> paired_fraction, longest_alone_outer_steps, handovers_served, handovers_abandoned;
  // The outer steps it took alone for want of the run's store (left out of
  // the pairing figures above, which judge the partners).
  std::optional<double> outer_steps_alone_without_store;
  struct Rejoin {
    int64_t step = 0;
    int donor = 0;
    double seconds = 0;
    bool joined = false;  // it joined the running run as a new member (not a restart)
  };
  std::optional<Rejoin> rejoin;
  std::optional<int64_t> left_at_step;  // it left the run (SIGTERM) after this step
  // Outages of the run's store it trained through, their seconds in all, and
  // (when it ended early, after left_at_step, for want of the store) why.
  int64_t store_outages = 0;
  double store_outage_seconds = 0;
  std::string store_gone;
  // The process's largest resident set (a corpus's mapped pages included),
  // and the seconds from its start until it was ready for its first step.
  std::optional<double> peak_rss_mib, startup_seconds;
  // What training asked of the run's store per outer step, from its first
  // step (heartbeats left out: they go by the clock): requests, KiB answered.
  std::optional<double> store_requests_per_outer_step, store_kib_read_per_outer_step;
  // The evaluations across replicas at its last one: of how many replicas
  // weight_std and the mean model are, of how many alive (eval.spread_replicas).
  std::optional<double> spread_replicas, live_replicas;
  // A replica of several workers (replica_workers): each worker's own
  // figures; the replica's peak_rss_mib and startup_seconds are their largest.
  struct ReplicaWorker {
    int worker = 0;
    std::string device;
    double peak_rss_mib = 0, startup_seconds = 0;
  };
  std::vector<ReplicaWorker> workers;
  // Partners whose outer-step message it refused as diverged (one entry a
  // message), and the steps from which it went on with a live replica's
  // state after a partner refused its own.
  std::vector<int> refused_as_diverged;
  std::vector<int64_t> renewed_at_steps;
  // The relays its exchanges and collectives went through (host:port), if any.
  std::vector<std::string> relays_used;
  // How its link to each partner it exchanged with went, by the partner's
  // rank: "direct", "punched" or "relayed".
  std::map<int, std::string> routes;
  nlohmann::json to_json() const;
  static WorkerSummary from_json(const nlohmann::json& j);
};

struct RunSummary {
  struct Worker {
    int replica = 0;
    std::optional<int> worker, stage;  // in a pipelined run
    std::string reason;
    double seconds = 0;
  };
  Method method = Method::none;
  int64_t replicas = 1, steps = 0, params = 0, tokens = 0, collectives = 0;
  // The replicas that finished, by number; in a pipelined run the workers
  // (replica · stages + stage), which workers_finished names by replica and stage.
  std::vector<int> finished;
  std::vector<Worker> workers_finished;
  std::vector<Worker> failed, restarted;
  std::vector<Worker> left;  // left the run on purpose (SIGTERM) before the end: neither finished nor failed
  // New members that joined the running run (noloco join): where they took a
  // live replica's state, and how long the hand-over took.
  struct Joined {
    int replica = 0;
    std::optional<int64_t> step;  // unknown for a joiner that wrote its summary on another machine
    std::optional<int> donor;
    std::optional<double> handover_seconds;
  };
  std::vector<Joined> joined;
  // The mean of final_val_loss_replicas (one a replica that finished); with
  // none finished, of the last evaluations of the replicas that left.
  std::optional<double> final_val_loss, final_val_loss_mean_model, weight_std;
  std::vector<double> final_val_loss_replicas;
  // The finished replica of the lowest final validation loss, and the model
  // `export` takes by default ("mean" or "replica N"; train/model_choice.h).
  std::optional<int> best_replica;
  std::optional<double> final_val_loss_best_replica;
  std::string handed_over;
  // Each finished replica's pace and wait, in the order of final_val_loss_replicas.
  std::vector<double> steps_per_second_replicas, steps_per_outer_step_replicas, outer_blocked_seconds_replicas;
  std::optional<double> bits_per_param_per_outer_step;  // mean over the workers that finished
  std::optional<double> bits_per_param_per_inner_step;  // likewise
  std::optional<double> steps_per_outer_step;
  std::optional<double> dropped_fraction;               // likewise
  std::optional<double> dropped_fraction_worst_outer_step;  // the largest of any worker
  std::optional<double> outer_blocked_seconds_per_replica;  // likewise
  std::optional<double> worker_peak_rss_mib, worker_startup_seconds;  // the largest of any worker
  std::optional<double> store_requests_per_outer_step, store_kib_read_per_outer_step;  // mean over the workers
  std::optional<double> spread_replicas, live_replicas;  // the evaluation that gave weight_std
  std::optional<double> paired_fraction_worst, longest_alone_outer_steps;  // the worst of any replica
  std::optional<double> outer_steps_alone_without_store;                  // the most of any replica
  std::optional<double> handovers_served, handovers_abandoned;          // summed over the replicas
  // Replicas that had no partner at more than kMostlyAlone of their outer steps.
  std::vector<int> replicas_mostly_alone;
  // Replicas whose messages a partner refused as diverged, and those that
  // then took a live replica's state.
  std::vector<int> replicas_refused_as_diverged, replicas_renewed;
  uint64_t bytes_sent = 0, bytes_received = 0;
  uint64_t bytes_relayed = 0;  // of bytes_sent: through a relay
  uint64_t bytes_punched = 0;  // of bytes_sent: through a hole punched in two NAT routers
  double comm_seconds = 0, wait_seconds = 0, comm_seconds_per_replica = 0, wait_seconds_per_replica = 0;
  double seconds = 0;
  // Pipelined runs.
  int64_t stages = 1, micro_batches = 1;
  std::string routing;
  std::string activation_codec, activation_grad_codec;  // what the training traffic between stages went as
  bool activation_rotation = false;                     // some of its integer codes Hadamard-rotated
  uint64_t activation_bytes_sent = 0;
  uint64_t activation_bytes_relayed = 0;  // of activation_bytes_sent: through a relay
  uint64_t activation_bytes_punched = 0;  // of activation_bytes_sent: through a punched hole
  double activation_bytes_per_step = 0;
  int64_t activation_subspace = 0;  // K; 0: none
  // activation_bytes_per_step × 8 over the hidden-state values a step's
  // boundaries carry (both directions, every micro-batch): 16 for bf16.
  double activation_bits_per_value = 0;
  std::vector<double> pipeline_idle_seconds_per_stage;
  // Summed over the workers: micro-batches given up because a worker on their route was lost.
  int64_t micro_batches_dropped = 0;

  nlohmann::json to_json() const;
  static RunSummary from_json(const nlohmann::json& j);
  static RunSummary read(const std::string& run_dir);
};

// A replica alone at more than this share of its outer steps, and for at
// least kAloneInARow of them in a row, is named in the run's summary: one
// missed exchange (a partner that left, in a short run) is not drift.
constexpr double kMostlyAlone = 0.1;
constexpr double kAloneInARow = 3;

// summary.json of a launched run, from the workers' summaries and how each ended.
// With several workers a replica, the first speaks for it; any that failed is listed.
RunSummary summarize_run(const std::string& run_dir, Method method, int64_t replicas, int64_t stages,
                         const std::string& routing, int64_t micro_batches, const std::vector<WorkerExit>& exits,
                         double seconds, int64_t replica_workers = 1);
// summary.json of a lone worker's run.
RunSummary summarize_lone_run(const WorkerSummary& worker);

// The spread of weights across replicas over the whole model, from each
// stage's (parameter count, spread): sqrt(Σ n·σ² / Σ n). NaN if any spread
// is NaN or there are no parameters.
double spread_over_stages(const std::vector<std::pair<double, double>>& stages);

// Markdown table comparing runs (each a run directory with summary.json), then pace_table's.
std::string comparison_table(const std::vector<std::string>& run_dirs);
// Where replicas trained unequal numbers of steps (pace=speed): each run's
// range of steps/s, inner steps an outer step and time waited. Empty where none did.
std::string pace_table(const std::vector<std::string>& run_dirs);

}  // namespace noloco
