#include "wire/message.h"

#include <fmt/format.h>

namespace noloco {

const char* message_kind_name(int64_t kind) {
  switch (MessageKind(kind)) {
    case MessageKind::exchange: return "outer exchange";
    case MessageKind::state: return "training state";
    case MessageKind::activations: return "activations";
    case MessageKind::gradients: return "gradients";
    case MessageKind::evaluation: return "evaluation activations";
    case MessageKind::greeting: return "group greeting";
    case MessageKind::collective: return "collective's piece";
  }
  return "unknown message";
}

std::array<int64_t, MessageHeader::kWords> MessageHeader::words() const {
  return {magic, run, kind, exchange, micro, boundary, origin, bytes, format};
}

MessageHeader MessageHeader::from_words(const int64_t* w) {
  return {w[0], w[1], w[2], w[3], w[4], w[5], w[6], w[7], w[8]};
}

std::string check_message_header(const MessageHeader& expected, const MessageHeader& got) {
  if (got.magic != expected.magic) return "not a noloco message";
  if (got.run != expected.run) return "message from another run (token mismatch)";
  if (got.kind != expected.kind)
    return fmt::format("got {}, expected {}", message_kind_name(got.kind), message_kind_name(expected.kind));
  if (got.exchange != expected.exchange || got.micro != expected.micro || got.boundary != expected.boundary)
    return fmt::format("{} of exchange {}, micro-batch {}, boundary {}; expected exchange {}, micro-batch {}, boundary {}",
                       message_kind_name(got.kind), got.exchange, got.micro, got.boundary, expected.exchange,
                       expected.micro, expected.boundary);
  if (got.origin != expected.origin)
    return fmt::format("data of replica {}, expected {} (workers disagree on the routes)", got.origin, expected.origin);
  if (got.bytes != expected.bytes) return fmt::format("{} payload bytes, expected {}", got.bytes, expected.bytes);
  if (got.format != expected.format)
    return fmt::format("payload format {}, expected {} (a different wire codec?)", got.format, expected.format);
  return "";
}

}  // namespace noloco
