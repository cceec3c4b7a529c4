// How a process becomes a worker of a run: launched into it (RANK set, by
// our launcher, torchrun or a script of the user's) or joining it while it
// trains (`noloco join`). Both start through train/worker_life.h and train
// with train/trainer.h; the Python door claims a joiner's place here too.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "config/train_config.h"
#include "config/worker_env.h"

namespace noloco {

// A worker launched into a run: trains to the end (or until it leaves);
// returns the exit code.
int run_launched_worker(TrainConfig& config, const WorkerEnv& env);

// `join RUN_DIR [key=value...]`: a new replica of a running NoLoCo run (a
// stage worker, pipelined; a replica of several workers, each a process of
// this machine, where the run's replicas have several). It claims the next
// member id from the run's store, takes a live replica's state at that
// replica's next outer step and trains with the others to the end (or, a
// replica of one worker, until SIGTERM).
int join_command(const std::string& run_dir, const std::vector<std::string>& args);
// The keys join_command takes, for `noloco join --help`.
std::string join_keys_help();

// A joiner's member id among the `replicas` the run started with, claimed
// from the run's store at env's address; with `stage` < 0 (pipelined) the
// stage with the fewest live workers is chosen and written to `stage`. The
// first contact is bounded (10 s at most); refused in one line naming the store.
int claim_joiner_member(const WorkerEnv& env, const TrainConfig& config, int replicas, int stages, int64_t& stage);

}  // namespace noloco
