// The header that precedes every point-to-point payload (outer-step
// exchanges, rejoin hand-overs, pipeline activations): the receiver checks it
// against what it expects before a byte of the payload is used, so a message
// from another run, another exchange, or of another shape is never averaged
// in. Torch-free: it is a parser of untrusted bytes and is fuzzed.
#pragma once
#include <array>
#include <cstdint>
#include <string>

namespace noloco {

enum class MessageKind : int64_t {
  exchange = 1,     // an outer-step exchange of a NoLoCo group
  state = 2,        // a live replica's training state, handed to a restarted one
  activations = 3,  // pipeline: a micro-batch's hidden states (the last stage samples the labels itself)
  gradients = 4,    // pipeline: their gradients, back along the same route
  evaluation = 5,   // pipeline: hidden states of an evaluation pass
  greeting = 6,     // a new Gloo group's members proving to each other that each pair reaches a member
  collective = 7,   // a piece of a collective over links (micro: which piece)
};
const char* message_kind_name(int64_t kind);

struct MessageHeader {
  static constexpr int64_t kMagic = 0x6e6f6c6f636f3031LL;  // "noloco01"
  static constexpr int kWords = 9;
  int64_t magic = kMagic;
  int64_t run = 0;       // hash of the run token
  int64_t kind = 0;      // MessageKind
  int64_t exchange = 0;  // outer exchange, pipeline step or evaluation number
  int64_t micro = 0;     // pipeline micro-batch
  int64_t boundary = 0;  // pipeline boundary (between stages boundary and boundary+1)
  int64_t origin = 0;    // pipeline: the data replica of the micro-batch
  int64_t bytes = 0;     // payload size
  int64_t format = 0;    // what the payload bytes encode (a codec or dtype id)

  // `format` of a pipeline notice with no payload: the micro-batch was
  // dropped upstream (or downstream, for gradients) because a worker was lost.
  static constexpr int64_t kDropped = -1;

  std::array<int64_t, kWords> words() const;
  static MessageHeader from_words(const int64_t* words);
  static constexpr size_t kBytes = kWords * sizeof(int64_t);
};

// Empty if `got` is what `expected` asks for, else the reason, naming the field.
std::string check_message_header(const MessageHeader& expected, const MessageHeader& got);

}  // namespace noloco
