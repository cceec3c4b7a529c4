// The pipeline's one door to the network: activations forward and their
// gradients back between the stages of different replicas, and the rosters
// that say who serves each stage at a step. What a message is (its header,
// checked by the receiver against what its own routing says it must be),
// how it is coded, and what a lost neighbour costs (the micro-batches routed
// through it are dropped and the neighbours downstream, or upstream for
// gradients, are told) are decided here; comm/transport/peer_link.h carries
// the framed, sealed bytes, as it does nothing else's.
//
// On the wire: the first tensor of a training message (hidden states
// forward, their gradients back) coded by its direction's wire codec, the
// rest (labels) and evaluation traffic exact. With a residual subspace
// (activation_subspace=K, model/subspace.h) that tensor travels as its K
// coordinates a token, then coded the same way; the receiver rebuilds the
// hidden states from the micro-batch's token ids, which it samples itself, so
// they never cross the network.
#pragma once
#include <algorithm>
#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "comm/membership/membership.h"
#include "comm/transport/peer_link.h"
#include "config/train_config.h"
#include "model/subspace.h"
#include "pipeline/pipeline_stats.h"
#include "wire/codec.h"
#include "wire/message.h"

namespace noloco {

// What a pipeline message is.
struct ActivationHeader {
  MessageKind kind = MessageKind::activations;
  int64_t step = 0;  // the inner step (of an evaluation: the step it follows)
  int64_t micro = 0;
  int64_t boundary = 0;
  int64_t origin = 0;  // the data replica the micro-batch's tokens came from
};

struct ActivationCodecs {
  CodecSpec activations, gradients;
};
// The codecs a config asks for. Gradients are rounded stochastically
// (unbiased, as SGD wants them); rotation applies to integer codes only.
ActivationCodecs activation_codecs(const TrainConfig& config);

class ActivationChannel {
 public:
  // Over `link` (its self() this worker's global rank, replica-major over
  // `stages`) and `rosters`, the pipeline's liveness authority, which the
  // link also reports its losses to.
  ActivationChannel(PipelineRoster& rosters, PeerLink& link, int stages, const ActivationCodecs& codecs = {},
                    std::shared_ptr<const ResidualSubspace> subspace = nullptr);

  // Takes the roster named `name` (a step; all workers ask for the same names
  // in the same order) and, when it lists a worker the current group lacks
  // (the first roster, or a restarted worker back in), forms a new group of
  // the listed workers. This worker may be missing from it: a restarted one
  // not yet back sits the step out. Throws if it was in an earlier roster and
  // is not now (its neighbours gave it up: it must be restarted to come back).
  const Roster& enter(const std::string& name);
  // This worker leaves the run (its stage's membership says so): rosters
  // that leave it out are expected from now on, not an error.
  void leave() { leaving_ = true; }
  // Whether the roster entered last lists this worker.
  bool listed() const { return listed_; }
  int incarnation() const { return link_.self().incarnation; }
  // The roster entered last, if any.
  const std::optional<Roster>& roster() const { return roster_; }

  // Starts sending `tensors` (CPU or device; at most two) to worker `peer`,
  // the first coded on the way; returns at once.
  void send(int peer, const ActivationHeader& header, const std::vector<torch::Tensor>& tensors);
  // Tells worker `peer` that the message `header` announces will not come.
  void send_dropped(int peer, const ActivationHeader& header);
  // Receives into `tensors` (CPU, preallocated with the expected shapes and
  // dtypes; a coded first tensor in contiguous fp32, [B, T, hidden]) from
  // worker `peer`. False if the micro-batch was dropped (a notice came, the
  // peer is lost or given up, or its coded payload did not decode: refused,
  // never applied); throws naming the difference if its header is not
  // `expected`. With a subspace, training activations need the micro-batch's
  // token `ids` [B, T], and the first tensor is replaced by one on the
  // subspace's device. Time blocked counts as idle.
  bool recv(int peer, const ActivationHeader& expected, std::vector<torch::Tensor>& tensors,
            const torch::Tensor& ids = {});
  // Waits until every send has left (or its peer is lost); call before the
  // sent tensors are reused.
  void finish_sends() { link_.finish_sends(); }

  PipelineStats stats() const;
  // The stage reports how many micro-batches it holds, for PipelineStats.
  void note_micro_batches_held(int64_t held) {
    stats_.peak_micro_batches_held = std::max(stats_.peak_micro_batches_held, held);
  }

 private:
  MessageHeader header_of(const ActivationHeader& h, const std::vector<torch::Tensor>& tensors) const;
  // The format a training message of `kind` is announced in (0: as it is):
  // its codec's, and the subspace's dimension, so peers that disagree refuse.
  int64_t format_for(MessageKind kind) const;
  // The codec a message of `kind` goes through; null: sent as it is.
  const WireCodec* codec_for(MessageKind kind) const;
  // The bytes as they travel: `tensors` with the first coded (or as they are).
  std::vector<torch::Tensor> wire_payload(const ActivationHeader& header, const std::vector<torch::Tensor>& tensors) const;
  // Receives the bytes as they travel into `wire`; false if dropped.
  bool receive_wire(int peer, const ActivationHeader& expected, std::vector<torch::Tensor>& wire, int64_t format);
  // Decodes a received first tensor into `target`; false (logged, counted as
  // dropped) if it does not decode.
  bool decode(int peer, const ActivationHeader& expected, const torch::Tensor& wire, torch::Tensor& values,
              torch::Tensor& target, const torch::Tensor& ids);
  static bool training(MessageKind kind) {
    return kind == MessageKind::activations || kind == MessageKind::gradients;
  }

  PipelineRoster& rosters_;
  PeerLink& link_;
  int stages_;
  WireCodec activation_codec_, gradient_codec_;
  std::shared_ptr<const ResidualSubspace> subspace_;
  std::optional<Roster> roster_;
  bool was_listed_ = false, listed_ = false, leaving_ = false;
  PipelineStats stats_;
};

}  // namespace noloco
