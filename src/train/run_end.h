// The run's summary.json, whoever writes it: our launcher from its workers'
// exits, or, in a run it did not start (plain environment, torchrun, `noloco
// serve`), worker 0 from what the run's store holds.
#pragma once
#include <string>
#include <vector>

#include "train/run_summary.h"

namespace noloco {

struct TrainConfig;
struct WorkerEnv;
struct JoinedWorker;

// summary.json of a run of `cfg`'s workers, from their summaries in
// cfg.run.out and how each ended (`members`: the launched workers' exits and
// the joiners').
RunSummary summarize_run(const TrainConfig& cfg, const std::vector<WorkerExit>& members, double seconds);

// Names the replicas that trained mostly alone, if any: such a run still
// finishes with exit code 0.
void warn_if_mostly_alone(const RunSummary& summary);

// Whether this worker writes the run's summary.json: worker 0 of a run that
// our launcher (which writes it itself) did not start.
bool writes_run_summary(const WorkerEnv& env);

// Worker 0 at the end of such a run: waits until every member (joiners
// included) has finished, or is given up by its heartbeat, or SIGTERM asks
// this worker to leave; then writes each replica's summary_r<k>.json that the
// store holds and this disk lacks (the machines need not share one), and
// summary.json. `seconds`: since this worker started.
void write_run_summary(const TrainConfig& cfg, const WorkerEnv& env, const JoinedWorker& worker, double seconds);

}  // namespace noloco
