// Starts N local workers the way torchrun does (RANK, WORLD_SIZE, LOCAL_RANK,
// MASTER_ADDR, MASTER_PORT), hosting the store itself so any worker may die.
#pragma once
#include <sys/types.h>

#include <algorithm>
#include <string>
#include <vector>

#include "comm/launch/capped_links.h"
#include "config/run_layout.h"
#include "config/train_config.h"

namespace noloco {

struct WorkerExit {
  int rank = 0;
  int exit_code = 0;  // -1 if killed by a signal
  int signal = 0;
  double seconds = 0;  // since launch
  bool restarted = false;  // the launcher started the worker again after this exit
  std::string why;         // set when the launcher itself ended the worker, or the store says it was lost
  // A worker that joined the running run (noloco join) rather than one this
  // launcher started: its end is what the run's store recorded.
  bool joined = false;
  bool ok() const { return exit_code == 0 && signal == 0; }
  std::string describe() const;
};

struct LaunchPlan {
  int workers = 1;
  int stages = 1;
  int replica_workers = 1;
  // Where each worker sits (config/run_layout.h).
  RunLayout layout() const { return RunLayout(stages, replica_workers, std::max(1, workers / (stages * replica_workers))); }
  std::string method;   // for messages
  CommConfig comm;
  // Unless set, the first failed worker ends the others; with it, a failed
  // worker is restarted up to comm.restarts times, and a pipelined run is
  // stopped once a stage has no worker left.
  bool keep_going_on_failure = false;
  // Each worker in its own network namespace behind a capped link (null: loopback).
  const CappedLinks* links = nullptr;
  // Where new workers can join the running run from (noloco join), and
  // where `noloco watch` finds it: the
  // launcher writes join.json there (how to reach its store) and, for a token
  // it made up, run_token (readable by its user only), and removes both when
  // the run ends. Empty: the run takes no joiners.
  std::string join_dir;
  // Workers of a resumed run that hold no checkpoint while others of their
  // stage do: started as restarted ones (they take a live replica's state).
  std::vector<int> start_from_peers;
  // Set: worker_args is a whole command of the user's (python3 train.py ...)
  // rather than this program's arguments. Such a worker is supervised by its
  // heartbeat only once it beats (once it has joined the run: it may prepare
  // for as long as it likes before), and nothing is appended to its command.
  bool users_program = false;
};

struct LaunchResult {
  std::vector<WorkerExit> exits;  // by rank; a restarted worker's in the order they happened
  std::vector<WorkerExit> joiners;  // workers that joined the run, by member id (WorkerExit::joined)
  int signal = 0;                 // SIGINT or SIGTERM that stopped the run, 0 if none did
  std::string stopped;            // why the launcher stopped a run that carries on without workers, if it did
};

// `worker_args` are the arguments after the program name (e.g. train CONFIG
// k=v...). Hosts the run's store (etcd), starts the workers and supervises
// them until all end. A SIGINT or SIGTERM at any moment (also while starting)
// is forwarded to the workers started so far, which get 10 s before SIGKILL.
// Once its own workers have ended it waits for the joiners to finish or be
// given up (their heartbeat silent for heartbeat_timeout).
LaunchResult launch_local_workers(const LaunchPlan& plan, const std::vector<std::string>& worker_args);

// What a joiner on this machine finds in a run's join directory while the
// run is on (LaunchPlan::join_dir): the store's endpoint, the workers the
// launcher started, and the token where the launcher made it up.
struct JoinInvitationFile {
  std::string store;
  int workers = 0;
};
// Throws std::invalid_argument, in one line headed by `command` (join,
// watch), when DIR holds no invitation (the run is not on here) or a
// malformed one.
JoinInvitationFile read_join_invitation(const std::string& dir, const std::string& command);
// The run's token for a joiner, a watcher or a serve taking its run back:
// NOLOCO_RUN_TOKEN, else `token_file` (the launcher's run_token in the join
// directory, the token a serve kept), which only its owner may read. Its errors are headed by `command`, as above.
std::string run_token_of(const std::string& token_file, const std::string& command);

// Starts `command` (its program looked up on PATH) with `env` (NAME=value)
// added to the environment, in network namespace `netns` if one is named; it
// gets SIGTERM when the process that started it dies.
pid_t start_process(const std::vector<std::string>& command, std::vector<std::string> env,
                    const std::string& netns = "");
// The same for this program (/proc/self/exe) with `args` after its name.
pid_t start_noloco_process(const std::vector<std::string>& args, std::vector<std::string> env,
                           const std::string& netns = "");

// How many workers this machine can host: 8 per core, and its available
// memory at `bytes_per_worker` each. Throws std::invalid_argument naming the
// limit when `workers` exceeds it and `allowed` (an explicit maximum, 0:
// none) does not permit it.
void check_local_capacity(int64_t workers, int64_t bytes_per_worker, int64_t allowed);

}  // namespace noloco
