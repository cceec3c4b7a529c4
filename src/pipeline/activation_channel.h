// What pipeline traffic holds on the wire: the first tensor of a training
// message (hidden states forward, their gradients back) coded by its
// direction's wire codec, the rest (labels) and evaluation traffic exact.
// The link below carries the bytes; this is the pipeline's half of the same
// shape outer messages have (code → frame and seal → decode).
#pragma once
#include <vector>

#include <torch/torch.h>

#include "comm/transport/activation_link.h"
#include "config/train_config.h"
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
  ActivationChannel(ActivationLink& link, const ActivationCodecs& codecs);

  // As ActivationLink's, with `tensors[0]` coded on the way.
  void send(int peer, const ActivationHeader& header, const std::vector<torch::Tensor>& tensors);
  // Receives into `tensors` (CPU, preallocated; a coded first tensor in
  // contiguous fp32). False if the micro-batch was dropped, or its coded
  // payload did not decode (refused, never applied).
  bool recv(int peer, const ActivationHeader& expected, std::vector<torch::Tensor>& tensors);

  ActivationLink& link() { return link_; }

 private:
  // The codec a message of `kind` goes through; null: sent as it is.
  const WireCodec* codec_for(MessageKind kind) const;

  ActivationLink& link_;
  WireCodec activation_codec_, gradient_codec_;
};

}  // namespace noloco
