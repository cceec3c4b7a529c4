// One point-to-point message over a link (comm/link/link.h): its
// MessageHeader as one link message, then, when the header announces bytes,
// its payload as the next. Every message that crosses between sites goes
// through here (outer exchanges, hand-overs, collectives' pieces, the
// pipeline's activations), so that what checks a header is written once.
//
// The link seals every frame (unless the run is unsealed), so a payload
// needs no seal of its own: a header or payload changed on the way breaks
// the link before a byte of it is used. A header that is not the expected
// one is rejected, its payload read past: the link carries on.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "comm/link/link.h"
#include "wire/message.h"

namespace noloco {

enum class Delivery {
  received,     // the header was the expected one; the payload came whole
  dropped,      // a dropped_notice of the expected message came instead
  peer_lost,    // the link broke or timed out: the peer died or is unreachable
  rejected,     // the header was not the expected one; the problem says why
  unauthentic,  // a frame failed its seal (changed, replayed, another token): never used
};

// The notice sent in place of a message that will not come (a pipeline
// message a lost worker on its route will not produce): `header` with no payload.
MessageHeader dropped_notice(MessageHeader header);

// False when the link broke before everything left by `deadline`.
bool send_message(Link& link, const MessageHeader& header, const std::vector<Link::Part>& payload,
                  Clock::time_point deadline);

struct Incoming {
  Delivery delivery = Delivery::peer_lost;
  MessageHeader header;  // as it came
  std::string problem;   // unless received or dropped
};

// The next message on `link`, its header checked against `expected`; its
// payload lands in `place(header)`'s slots (their sizes adding up to
// header.bytes), asked only once the header passed. With `max_bytes` >= 0
// the header's size is taken up to it instead of checked against expected.
// `dropped_ok`: a dropped_notice of the expected message is a delivery.
Incoming receive_message(Link& link, MessageHeader expected, const std::function<std::vector<Link::Slot>(const MessageHeader&)>& place,
                         Clock::time_point deadline, bool dropped_ok = false, int64_t max_bytes = -1);

// One message out on each of several links and one in from each, all at
// once, each on its own thread: no link waits for another, and on each both
// directions flow together (a pair's two uploads overlap).
struct LinkTrade {
  Link* link = nullptr;
  bool send = true, receive = true;
  MessageHeader header;                // sent
  std::vector<Link::Part> payload;     // header.bytes in all
  MessageHeader expected;              // received
  std::function<std::vector<Link::Slot>(const MessageHeader&)> place;
  // Out:
  bool sent = false;
  Incoming incoming;
  uint64_t bytes_sent = 0, bytes_received = 0;  // on the wire, framing and sealing included
};
void trade_messages(std::vector<LinkTrade>& trades, Clock::time_point deadline);

}  // namespace noloco
