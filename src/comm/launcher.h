// Starts N local workers the way torchrun does (RANK, WORLD_SIZE, LOCAL_RANK,
// MASTER_ADDR, MASTER_PORT), hosting the store itself so any worker may die.
#pragma once
#include <string>
#include <vector>

#include "comm/capped_links.h"
#include "config/train_config.h"

namespace noloco {

struct WorkerExit {
  int rank = 0;
  int exit_code = 0;  // -1 if killed by a signal
  int signal = 0;
  double seconds = 0;  // since launch
  bool restarted = false;  // the launcher started the worker again after this exit
  std::string why;         // set when the launcher itself ended the worker
  bool ok() const { return exit_code == 0 && signal == 0; }
  std::string describe() const;
};

struct LaunchPlan {
  int workers = 1;
  int stages = 1;       // workers are replica-major: worker w is stage w % stages of replica w / stages
  std::string method;   // for messages
  CommConfig comm;
  // Unless set, the first failed worker ends the others; with it, a failed
  // worker is restarted up to comm.restarts times.
  bool keep_going_on_failure = false;
  // Each worker in its own network namespace behind a capped link (null: loopback).
  const CappedLinks* links = nullptr;
};

// `worker_args` are the arguments after the program name (e.g. train CONFIG k=v...).
// Supervises until all workers end; forwards SIGINT/SIGTERM. Exits are sorted
// by rank, a restarted worker's in the order they happened.
std::vector<WorkerExit> launch_local_workers(const LaunchPlan& plan, const std::vector<std::string>& worker_args);

}  // namespace noloco
