// What a worker's traffic cost it, counted by the transports. Torch-free, so
// summaries and reports can use it.
#pragma once
#include <cstdint>

namespace noloco {

// Training traffic of the outer method.
struct CommStats {
  uint64_t bytes_sent = 0, bytes_received = 0;
  // Of bytes_sent, those that went through a relay (each message by the
  // share of its group's connections that were relayed: exact for a pair).
  uint64_t bytes_relayed = 0;
  double comm_seconds = 0;  // inside communication calls, waiting included
  double wait_seconds = 0;  // of which blocked on peers (time until their data arrived)
  int64_t collectives = 0;  // all-reduce and other collective calls
  int64_t messages = 0;     // point-to-point payloads sent

  CommStats& operator+=(const CommStats& o) {
    bytes_sent += o.bytes_sent;
    bytes_received += o.bytes_received;
    bytes_relayed += o.bytes_relayed;
    comm_seconds += o.comm_seconds;
    wait_seconds += o.wait_seconds;
    collectives += o.collectives;
    messages += o.messages;
    return *this;
  }
};

}  // namespace noloco
