// One framed point-to-point message on a Gloo group: a MessageHeader, then
// the payload parts it announces, on consecutive tags. Every point-to-point
// path (outer exchanges, the state hand-over, the pipeline's messages) sends and
// receives through here, so that what checks, compresses or seals a payload
// plugs in once.
//
// Gloo aborts the receiving process when a message is larger than the posted
// buffer, so a payload is only ever received into buffers of the size a
// checked header announced, or of a size both ends agreed on beforehand.
//
// With a Seal (comm/transport/seal.h) every payload part travels sealed, bound to the
// header, its part number and the pair's direction; the header itself goes
// in clear (it is checked, and any change to it fails the payload's seal).
#pragma once
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/torch.h>

#include "comm/transport/link_messages.h"  // Delivery, dropped_notice
#include "wire/message.h"

namespace noloco {

class Seal;

// Tags one framed message takes: the header's, then one per payload part.
constexpr int framed_tags(int parts) { return 1 + parts; }

class FramedSend {
 public:
  // Starts sending to group member `member` from `tag` on; returns at once.
  // `header.bytes` must be the parts' size; `seal` null: in clear. `corrupt`
  // (a failure drill) flips one payload byte on the wire. Throws if the pair is closed.
  FramedSend(c10d::ProcessGroupGloo& group, int member, int tag, const MessageHeader& header,
             std::vector<torch::Tensor> parts, const Seal* seal, bool corrupt = false);
  // Throws if the peer is lost before everything left, or the send was aborted.
  void wait(std::chrono::milliseconds timeout);
  // Ends a wait on another thread (the group is being given up).
  void abort();
  uint64_t payload_bytes() const { return payload_bytes_; }
  // What leaves for it: the header and the payload, sealed or not.
  uint64_t wire_bytes() const { return wire_bytes_; }

 private:
  std::vector<c10::intrusive_ptr<c10d::Work>> works_;
  std::vector<torch::Tensor> tensors_;  // alive until sent
  uint64_t payload_bytes_ = 0, wire_bytes_ = 0;
};

class FramedReceive {
 public:
  // Receives from member `member` from `tag` on into `parts` (CPU, contiguous,
  // their total size `expected.bytes`). The header's receive is posted at once;
  // with `eager`, the parts' too, which keeps both directions of a pair busy
  // (peers that exchange must post every receive before any send), and is only
  // for messages that always come whole (never a dropped notice). Throws if
  // the pair is closed.
  // `seal`: as the sender's (null: in clear).
  FramedReceive(c10d::ProcessGroupGloo& group, int member, int tag, MessageHeader expected,
                std::vector<torch::Tensor> parts, bool eager, const Seal* seal);
  // A message of any size up to `max_bytes`, received into one uint8 tensor
  // allocated after its header is checked (a training state).
  FramedReceive(c10d::ProcessGroupGloo& group, int member, int tag, MessageHeader expected, int64_t max_bytes,
                const Seal* seal);
  Delivery wait(std::chrono::milliseconds timeout);
  // Ends a wait on another thread (it returns peer_lost): the group is being
  // given up. A lazy receive posts no parts after it.
  void abort();
  const std::string& problem() const { return problem_; }
  std::vector<torch::Tensor>& parts() { return parts_; }
  // What came for it: the header and the payload, sealed or not.
  uint64_t wire_bytes() const;

 private:
  void post_parts();
  Delivery check_header();
  bool open_parts();

  c10d::ProcessGroupGloo* group_;
  int member_, tag_;
  MessageHeader expected_, got_;
  torch::Tensor header_words_;
  std::vector<torch::Tensor> parts_;
  std::vector<torch::Tensor> sealed_;  // what arrives, when sealed: opened into parts_
  bool eager_;
  const Seal* seal_;
  int64_t max_bytes_ = -1;  // >= 0: the size comes from the header
  c10::intrusive_ptr<c10d::Work> header_work_;
  std::vector<c10::intrusive_ptr<c10d::Work>> part_works_;
  std::unique_ptr<std::mutex> posting_ = std::make_unique<std::mutex>();  // part_works_ against abort()
  bool aborted_ = false;
  std::string problem_;
};

}  // namespace noloco
