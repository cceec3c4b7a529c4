// Where each worker of a run sits, and which rank sits where: the one place
// that encodes or decodes a rank. Ranks go replica by replica, then by the
// replica's workers, then by its pipeline stages:
//   rank = (replica * replica_workers + replica_worker) * stages + stage
// A replica is either several workers of one stage (a data-parallel group of
// its own) or a pipeline of one worker a stage; both at once are refused
// here. Joiners take the ranks after the run's own: nothing here bounds a
// rank by the world.
#pragma once
#include <stdexcept>
#include <vector>

namespace noloco {

struct TrainConfig;

struct RunPlace {
  int replica = 0, replica_worker = 0, stage = 0;
};

class RunLayout {
 public:
  RunLayout(int stages, int replica_workers, int replicas = 1)
      : stages_(stages), replica_workers_(replica_workers), replicas_(replicas) {
    if (stages < 1 || replica_workers < 1 || replicas < 1)
      throw std::invalid_argument("stages, replica_workers and replicas must be positive");
    if (stages > 1 && replica_workers > 1)
      throw std::invalid_argument(
          "replica_workers > 1 with pipeline stages is not implemented: set stages=1 or replica_workers=1");
  }

  int stages() const { return stages_; }
  int replica_workers() const { return replica_workers_; }
  int replicas() const { return replicas_; }
  int workers_per_replica() const { return stages_ * replica_workers_; }
  int world() const { return replicas_ * workers_per_replica(); }

  int rank(const RunPlace& p) const { return (p.replica * replica_workers_ + p.replica_worker) * stages_ + p.stage; }
  RunPlace place(int rank) const { return {replica_of(rank), replica_worker_of(rank), stage_of(rank)}; }
  int replica_of(int rank) const { return rank / workers_per_replica(); }
  int replica_worker_of(int rank) const { return rank / stages_ % replica_workers_; }
  int stage_of(int rank) const { return rank % stages_; }

  // The worker that speaks for a replica at a stage, its first: it holds the
  // links between replicas and writes the replica's metrics and checkpoints.
  int speaker(int replica, int stage = 0) const { return rank({replica, 0, stage}); }
  int speaker_of(int rank) const { return speaker(replica_of(rank), stage_of(rank)); }

  // Which rows of the data a whole model's worker reads: the replicas'
  // workers one after another (with one stage, its rank).
  int data_stream_of(int rank) const { return replica_of(rank) * replica_workers_ + replica_worker_of(rank); }

  // One copy of one stage (a replica's workers at that stage), numbered
  // replica * stages + stage: restarted together, summarised together.
  int unit_of(int rank) const { return replica_of(rank) * stages_ + stage_of(rank); }
  std::vector<int> ranks_of_unit(int unit) const {
    std::vector<int> ranks;
    for (int w = 0; w < replica_workers_; ++w) ranks.push_back(rank({unit / stages_, w, unit % stages_}));
    return ranks;
  }

 private:
  int stages_, replica_workers_, replicas_;
};

// The layout of a config's run (stages, replica_workers, replicas).
RunLayout run_layout(const TrainConfig& config);

}  // namespace noloco
