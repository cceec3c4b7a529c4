// Point-to-point transport of pipeline activations and their gradients
// between the stages of different replicas, over its own Gloo process group.
#pragma once
#include <algorithm>
#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "comm/comm_stats.h"
#include "comm/gloo_transport.h"
#include "comm/message.h"

namespace noloco {

// What a pipeline message is: checked by the receiver against what its own
// routing says it must be, before the payload is used.
struct ActivationHeader {
  MessageKind kind = MessageKind::activations;
  int64_t step = 0;  // the inner step, or the evaluation number
  int64_t micro = 0;
  int64_t boundary = 0;
  int64_t origin = 0;  // the data replica the micro-batch's tokens came from
};

class ActivationLink {
 public:
  // All workers of the run (global ranks) in one group named "pipeline".
  ActivationLink(const StorePtr& store, const WorkerEnv& env, const std::string& bind,
                 std::chrono::milliseconds timeout);
  ~ActivationLink();

  // Starts sending `tensors` (CPU or device) to worker `peer`; returns at once.
  void send(int peer, const ActivationHeader& header, const std::vector<torch::Tensor>& tensors);
  // Receives into `tensors` (CPU, preallocated with the expected shapes and
  // dtypes) from worker `peer`; throws naming the difference if its header is
  // not `expected`. Time spent blocked is charged as idle.
  void recv(int peer, const ActivationHeader& expected, std::vector<torch::Tensor>& tensors);
  // Waits until every send has left; call before the sent tensors are reused.
  void finish_sends();

  const PipelineStats& stats() const { return stats_; }
  // The stage reports how many micro-batches it holds, for PipelineStats.
  void note_micro_batches_held(int64_t held) {
    stats_.peak_micro_batches_held = std::max(stats_.peak_micro_batches_held, held);
  }

 private:
  int next_tag(std::map<int, int64_t>& counters, int peer);
  MessageHeader header_of(const ActivationHeader& h, const std::vector<torch::Tensor>& tensors) const;

  int rank_;
  std::chrono::milliseconds timeout_;
  int64_t run_id_;
  GlooGroup pg_;
  // Messages per directed pair, counted identically by sender and receiver: their tags.
  std::map<int, int64_t> sent_to_, received_from_;
  std::vector<std::function<void()>> waits_;  // one per send in flight; keeps its tensors alive
  PipelineStats stats_;
};

}  // namespace noloco
