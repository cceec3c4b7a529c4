// What pipeline traffic holds on the wire: the first tensor of a training
// message (hidden states forward, their gradients back) coded by its
// direction's wire codec, the rest (labels) and evaluation traffic exact.
// With a residual subspace (activation_subspace=K, model/subspace.h) that
// tensor travels as its K coordinates a token, then coded the same way; the
// receiver rebuilds the hidden states from the micro-batch's token ids, which
// it samples itself, so they never cross the network.
// The link below carries the bytes; this is the pipeline's half of the same
// shape outer messages have (code → frame and seal → decode).
#pragma once
#include <memory>
#include <vector>

#include <torch/torch.h>

#include "comm/transport/activation_link.h"
#include "config/train_config.h"
#include "model/subspace.h"
#include "wire/codec.h"

namespace noloco {

struct ActivationCodecs {
  CodecSpec activations, gradients;
};
// The codecs a config asks for. Gradients are rounded stochastically
// (unbiased, as SGD wants them); rotation applies to integer codes only.
ActivationCodecs activation_codecs(const TrainConfig& config);

class ActivationChannel {
 public:
  ActivationChannel(ActivationLink& link, const ActivationCodecs& codecs,
                    std::shared_ptr<const ResidualSubspace> subspace = nullptr);

  // As ActivationLink's, with `tensors[0]` coded on the way.
  void send(int peer, const ActivationHeader& header, const std::vector<torch::Tensor>& tensors);
  // Receives into `tensors` (CPU, preallocated; a coded first tensor in
  // contiguous fp32, [B, T, hidden]). False if the micro-batch was dropped,
  // or its coded payload did not decode (refused, never applied). With a
  // subspace, training activations need the micro-batch's token `ids` [B, T],
  // and the first tensor is replaced by one on the subspace's device.
  bool recv(int peer, const ActivationHeader& expected, std::vector<torch::Tensor>& tensors,
            const torch::Tensor& ids = {});

  ActivationLink& link() { return link_; }

 private:
  // The format a training message of `kind` is announced in (0: as it is):
  // its codec's, and the subspace's dimension, so peers that disagree refuse.
  int64_t format_for(MessageKind kind) const;
  // The codec a message of `kind` goes through; null: sent as it is.
  const WireCodec* codec_for(MessageKind kind) const;
  static bool training(MessageKind kind) {
    return kind == MessageKind::activations || kind == MessageKind::gradients;
  }

  ActivationLink& link_;
  WireCodec activation_codec_, gradient_codec_;
  std::shared_ptr<const ResidualSubspace> subspace_;
};

}  // namespace noloco
