// How a process becomes a worker of a run: alone (a world of one), launched
// into it (RANK set, by our launcher, torchrun or a script of the user's) or
// joining it while it trains (`noloco join`). All start through
// train/worker_life.h's start_worker and train with train/trainer.h; the
// Python door claims a joiner's place here too.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "config/train_config.h"
#include "config/worker_env.h"

namespace noloco {

// A worker of the run `env` places it in (a default WorkerEnv: a lone
// worker): trains to the end (or until it leaves), writes the run's summary
// where no launcher of ours does; returns the exit code.
int run_worker(TrainConfig& config, const WorkerEnv& env);

// A new replica of a running NoLoCo run, joining it from this machine
// (`noloco join`, cli/join_command.h): a stage worker, pipelined; a replica
// of several workers, each a process of this machine, where the run's
// replicas have several. It claims the next member id from the run's store,
// takes a live replica's state at that replica's next outer step and trains
// with the others to the end (or, a replica of one worker, until SIGTERM).
struct JoinRequest {
  std::string store;       // the run's store; empty: NOLOCO_STORE, else RUN_DIR/join.json's
  std::string token_file;  // where the token is when NOLOCO_RUN_TOKEN is unset
  int64_t stage = -1;      // pipelined: the stage to serve; -1: the one with the fewest live workers
};
// `overrides`: this machine's own keys; `args`: the command's, which the
// replica's other workers are started with. Returns the exit code.
int join_run(const std::string& run_dir, const JoinRequest& request, std::vector<std::string> overrides,
             const std::vector<std::string>& args);

// A joiner's member id among the `replicas` the run started with, claimed
// from the run's store at env's address; with `stage` < 0 (pipelined) the
// stage with the fewest live workers is chosen and written to `stage`. The
// first contact is bounded (10 s at most); refused in one line naming the store.
int claim_joiner_member(const WorkerEnv& env, const TrainConfig& config, int replicas, int stages, int64_t& stage);

}  // namespace noloco
