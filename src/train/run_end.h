// The run's summary.json, whoever ends the run: our launcher from its
// workers' exits; in a run it did not start (plain environment, torchrun,
// `noloco serve`), worker 0 from what the run's store holds; a lone worker
// from its own summary. save_run_summary is the file's one writer.
#pragma once
#include <string>
#include <vector>

#include "train/run_summary.h"

namespace noloco {

struct TrainConfig;
struct WorkerEnv;
struct Worker;

// summary.json of a run of `cfg`'s workers, from their summaries in
// cfg.run.out and how each ended (`members`: the launched workers' exits and
// the joiners').
RunSummary summarize_run(const TrainConfig& cfg, const std::vector<WorkerExit>& members, double seconds);

// Names the replicas that trained mostly alone, if any: such a run still
// finishes with exit code 0.
void warn_if_mostly_alone(const RunSummary& summary);

// Writes cfg.run.out/summary.json, except over the summary of the run a
// resume continued when every worker refused the resume (nothing finished).
void save_run_summary(const TrainConfig& cfg, const RunSummary& summary);

// Whether this worker writes the run's summary.json: worker 0 of a run that
// our launcher (which writes it itself) did not start.
bool writes_run_summary(const WorkerEnv& env);

// Worker 0 at the end of such a run: waits until every member (joiners
// included) has finished, or is given up by its heartbeat, or SIGTERM asks
// this worker to leave; then writes each replica's summary (worker_summary_path) that the
// store holds and this disk lacks (the machines need not share one), and
// summary.json. A world of one writes `own_summary` (what train returned) as
// the run's. `seconds`: since this worker started. Ended without the run's
// store (own_summary's store_gone), it writes what this disk holds; then a
// worker other than 0 writes it again where worker 0 wrote one on this disk.
// Any other worker returns at once.
void write_run_summary(const TrainConfig& cfg, const Worker& worker, const nlohmann::json& own_summary,
                       double seconds);

}  // namespace noloco
