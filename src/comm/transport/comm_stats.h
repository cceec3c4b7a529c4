// What a worker's traffic cost it, counted by the transports. Torch-free, so
// summaries and reports can use it.
#pragma once
#include <cstdint>

namespace noloco {

// Training traffic of the outer method.
struct CommStats {
  uint64_t bytes_sent = 0, bytes_received = 0;
  double comm_seconds = 0;  // inside communication calls, waiting included
  double wait_seconds = 0;  // of which blocked on peers (time until their data arrived)
  int64_t collectives = 0;  // all-reduce and other collective calls
  int64_t messages = 0;     // point-to-point payloads sent

  CommStats& operator+=(const CommStats& o) {
    bytes_sent += o.bytes_sent;
    bytes_received += o.bytes_received;
    comm_seconds += o.comm_seconds;
    wait_seconds += o.wait_seconds;
    collectives += o.collectives;
    messages += o.messages;
    return *this;
  }
};

// Pipeline activations and their gradients; evaluation passes are counted apart.
struct PipelineStats {
  uint64_t bytes_sent = 0, bytes_received = 0;
  double idle_seconds = 0;  // blocked waiting for activations or gradients (transfer included)
  int64_t messages = 0;
  uint64_t evaluation_bytes_sent = 0;
  // The most micro-batches whose activations the stage held at once (its
  // activation memory in units of one micro-batch): M under GPipe, at most
  // stages - stage under 1F1B.
  int64_t peak_micro_batches_held = 0;
  // Micro-batches this worker gave up because a worker on their route was
  // lost (its own, plus notices from neighbours), and the neighbours it lost.
  int64_t micro_batches_dropped = 0;
  int64_t peers_lost = 0;
};

}  // namespace noloco
