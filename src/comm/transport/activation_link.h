// Point-to-point transport of pipeline activations and their gradients
// between the stages of different replicas, over a Gloo process group of the
// live workers. Bytes only: what the tensors hold (coded values, labels) is
// the pipeline's business (pipeline/activation_channel.h). A lost neighbour (its pair fails: the process died, or the
// launcher killed it for a stopped heartbeat) does not stop the worker: the
// micro-batches routed through it are dropped, the neighbours downstream (or
// upstream, for gradients) are told, and the next step's roster leaves it out.
// Who is lost is the pipeline's liveness authority's (PipelineRoster): the
// link asks it before waiting for a neighbour and tells it whom it lost.
#pragma once
#include <algorithm>
#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "comm/transport/comm_stats.h"
#include "comm/transport/gloo_transport.h"
#include "comm/membership/membership.h"
#include "wire/message.h"

namespace noloco {

// What a pipeline message is: checked by the receiver against what its own
// routing says it must be, before the payload is used.
struct ActivationHeader {
  MessageKind kind = MessageKind::activations;
  int64_t step = 0;  // the inner step (of an evaluation: the step it follows)
  int64_t micro = 0;
  int64_t boundary = 0;
  int64_t origin = 0;  // the data replica the micro-batch's tokens came from
};

class ActivationLink {
 public:
  // Worker env.rank (replica-major over `stages`) in its `incarnation`.
  // With `seal`, every payload travels sealed (comm/transport/seal.h); null: in clear.
  // A neighbour whose heartbeat is silent for `heartbeat_timeout` is not waited for.
  ActivationLink(const StorePtr& store, const WorkerEnv& env, int stages, int incarnation, const std::string& bind,
                 std::chrono::milliseconds timeout, std::chrono::milliseconds heartbeat_timeout,
                 std::shared_ptr<const Seal> seal);
  ~ActivationLink();

  // Takes the roster named `name` (a step; all workers ask for the same names
  // in the same order) and, when it lists a worker the current group lacks (the
  // first roster, or a restarted worker back in), forms a new group of the
  // listed workers. This worker may be missing from it: a restarted one not
  // yet back sits the step out. Throws if it was in an earlier roster and is
  // not now (its neighbours gave it up: it must be restarted to come back).
  const Roster& enter(const std::string& name);
  // This worker leaves the run (its stage's membership says so): rosters
  // that leave it out are expected from now on, not an error.
  void leave() { leaving_ = true; }
  // Whether the roster entered last lists this worker.
  bool listed() const { return listed_; }
  int incarnation() const { return self_.incarnation; }
  // The roster entered last, if any.
  const std::optional<Roster>& roster() const { return roster_; }

  // Starts sending `tensors` (CPU or device) to worker `peer`, announced as
  // coded in `format` (0: as they are; the receiver must expect the same);
  // returns at once.
  void send(int peer, const ActivationHeader& header, const std::vector<torch::Tensor>& tensors, int64_t format = 0);
  // Tells worker `peer` that the message `header` announces will not come.
  void send_dropped(int peer, const ActivationHeader& header);
  // Receives into `tensors` (CPU, preallocated with the expected shapes and
  // dtypes, in `format`) from worker `peer`. False if the micro-batch was
  // dropped (a notice came, or the pair failed or the liveness authority
  // gave the peer up: it is lost); throws
  // naming the difference if its header is not `expected`. Time blocked
  // counts as idle.
  bool recv(int peer, const ActivationHeader& expected, std::vector<torch::Tensor>& tensors, int64_t format = 0);
  // A received training message whose payload the receiver refused (it did
  // not decode) counts as a dropped micro-batch.
  void note_refused() { stats_.micro_batches_dropped += 1; }
  // Waits until every send has left (or its peer is lost); call before the
  // sent tensors are reused.
  void finish_sends();

  const PipelineStats& stats() const { return stats_; }
  // The stage reports how many micro-batches it holds, for PipelineStats.
  void note_micro_batches_held(int64_t held) {
    stats_.peak_micro_batches_held = std::max(stats_.peak_micro_batches_held, held);
  }

 private:
  int next_tag(std::vector<int64_t>& counters, int member);
  MessageHeader header_of(const ActivationHeader& h, const std::vector<torch::Tensor>& tensors) const;
  // The group rank of worker `peer`; -1 if it is not in the group or is lost.
  int member_of(int peer) const;
  void lose(int peer, const std::string& why);
  void post(int peer, const MessageHeader& header, std::vector<torch::Tensor> payload, bool evaluation);

  StorePtr store_;
  WorkerEnv env_;
  int stages_;
  Peer self_;  // rank: this worker's global rank
  std::chrono::milliseconds timeout_;
  int64_t run_id_;
  std::shared_ptr<const Seal> seal_;
  PipelineRoster rosters_;
  std::optional<Roster> roster_;
  bool was_listed_ = false, listed_ = false, leaving_ = false;
  std::shared_ptr<gloo::transport::Device> device_;
  GlooGroup pg_;
  std::vector<GlooGroup> retired_;  // earlier groups: peers may still be reading from them
  std::vector<Peer> members_;       // of pg_, by group rank (rank: global worker rank)
  std::set<int> lost_;              // global ranks whose pair failed in this group
  // Messages per directed pair (by group rank), counted identically by sender and receiver: their tags.
  std::vector<int64_t> sent_to_, received_from_;
  struct Pending {
    int peer;
    std::function<void()> wait;  // keeps its tensors alive
  };
  std::vector<Pending> pending_;
  PipelineStats stats_;
};

}  // namespace noloco
