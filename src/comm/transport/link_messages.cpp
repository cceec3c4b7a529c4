#include "comm/transport/link_messages.h"

#include <thread>

#include <fmt/format.h>

namespace noloco {

MessageHeader dropped_notice(MessageHeader header) {
  header.bytes = 0;
  header.format = MessageHeader::kDropped;
  return header;
}

bool send_message(Link& link, const MessageHeader& header, const std::vector<Link::Part>& payload,
                  Clock::time_point deadline) {
  const auto words = header.words();
  if (!link.send({{reinterpret_cast<const uint8_t*>(words.data()), MessageHeader::kBytes}}, deadline)) return false;
  return header.bytes == 0 || link.send(payload, deadline);
}

namespace {

Incoming lost(const Link& link) {
  Incoming in;
  in.delivery = link.unauthentic() ? Delivery::unauthentic : Delivery::peer_lost;
  in.problem = link.problem();
  return in;
}

}  // namespace

Incoming receive_message(Link& link, MessageHeader expected,
                         const std::function<std::vector<Link::Slot>(const MessageHeader&)>& place,
                         Clock::time_point deadline, bool dropped_ok, int64_t max_bytes) {
  std::array<int64_t, MessageHeader::kWords> words{};
  const auto got = link.receive(reinterpret_cast<uint8_t*>(words.data()), MessageHeader::kBytes, deadline);
  if (got < 0) return lost(link);
  Incoming in;
  in.header = MessageHeader::from_words(words.data());
  if (got != int64_t(MessageHeader::kBytes)) {
    in.delivery = Delivery::rejected;
    in.problem = fmt::format("a header of {} bytes, expected {}", got, MessageHeader::kBytes);
    link.shut();
    return in;
  }
  if (dropped_ok && check_message_header(dropped_notice(expected), in.header).empty()) {
    in.delivery = Delivery::dropped;
    return in;
  }
  if (max_bytes >= 0 && in.header.bytes >= 0 && in.header.bytes <= max_bytes) expected.bytes = in.header.bytes;
  in.problem = check_message_header(expected, in.header);
  if (!in.problem.empty() && max_bytes >= 0 && in.header.bytes > max_bytes)
    in.problem = fmt::format("{} payload bytes, at most {} expected", in.header.bytes, max_bytes);
  if (!in.problem.empty()) {
    in.delivery = Delivery::rejected;
    // Its payload follows: read past (a frame at a time, whatever its size:
    // the sender proved the run's token), so that the link carries on.
    if (in.header.bytes > 0 && link.skip(deadline) < 0) link.shut();
    return in;
  }
  if (in.header.bytes > 0) {
    const auto slots = place(in.header);
    const auto size = link.receive(slots, deadline);
    if (size < 0) return lost(link);
    if (size != in.header.bytes) {
      in.delivery = Delivery::rejected;
      in.problem = fmt::format("a payload of {} bytes, its header announced {}", size, in.header.bytes);
      link.shut();
      return in;
    }
  }
  in.delivery = Delivery::received;
  return in;
}

void trade_messages(std::vector<LinkTrade>& trades, Clock::time_point deadline) {
  std::vector<std::thread> threads;
  for (auto& t : trades) {
    if (t.send)
      threads.emplace_back([&t, deadline] {
        const auto before = t.link->bytes_sent();
        t.sent = send_message(*t.link, t.header, t.payload, deadline);
        t.bytes_sent = t.link->bytes_sent() - before;
      });
    if (t.receive)
      threads.emplace_back([&t, deadline] {
        const auto before = t.link->bytes_received();
        t.incoming = receive_message(*t.link, t.expected, t.place, deadline);
        t.bytes_received = t.link->bytes_received() - before;
      });
  }
  for (auto& thread : threads) thread.join();
}

}  // namespace noloco
