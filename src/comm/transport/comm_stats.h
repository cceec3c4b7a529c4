// What a worker's traffic cost it, counted by the transports. Torch-free, so
// summaries and reports can use it.
#pragma once
#include <cstdint>

#include "comm/link/link.h"

namespace noloco {

// Training traffic of the outer method.
struct CommStats {
  uint64_t bytes_sent = 0, bytes_received = 0;
  // Of bytes_sent, those that went through a relay.
  uint64_t bytes_relayed = 0;
  // Of bytes_sent, those that went through a hole punched in two NAT routers
  // (the rest of what is neither went direct).
  uint64_t bytes_punched = 0;
  double comm_seconds = 0;  // inside communication calls, waiting included
  double wait_seconds = 0;  // of which blocked on peers (time until their data arrived)
  int64_t collectives = 0;  // all-reduce and other collective calls
  int64_t messages = 0;     // point-to-point payloads sent

  // `bytes` sent over a link that went `route`.
  void sent_over(LinkRoute route, uint64_t bytes) {
    bytes_sent += bytes;
    if (route == LinkRoute::relayed) bytes_relayed += bytes;
    if (route == LinkRoute::punched) bytes_punched += bytes;
  }

  CommStats& operator+=(const CommStats& o) {
    bytes_sent += o.bytes_sent;
    bytes_received += o.bytes_received;
    bytes_relayed += o.bytes_relayed;
    bytes_punched += o.bytes_punched;
    comm_seconds += o.comm_seconds;
    wait_seconds += o.wait_seconds;
    collectives += o.collectives;
    messages += o.messages;
    return *this;
  }
  // What was added since `earlier` (the same counters, read before).
  CommStats& operator-=(const CommStats& earlier) {
    bytes_sent -= earlier.bytes_sent;
    bytes_received -= earlier.bytes_received;
    bytes_relayed -= earlier.bytes_relayed;
    bytes_punched -= earlier.bytes_punched;
    comm_seconds -= earlier.comm_seconds;
    wait_seconds -= earlier.wait_seconds;
    collectives -= earlier.collectives;
    messages -= earlier.messages;
    return *this;
  }
};

}  // namespace noloco
