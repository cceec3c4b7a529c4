// What a pipeline stage's traffic with its neighbours cost it, counted by
// its activation channel. Torch-free, so summaries and reports can use it.
#pragma once
#include <cstdint>

namespace noloco {

// Pipeline activations and their gradients; evaluation passes are counted apart.
struct PipelineStats {
  uint64_t bytes_sent = 0, bytes_received = 0;
  uint64_t bytes_relayed = 0;  // of bytes_sent: through a relay
  uint64_t bytes_punched = 0;  // of bytes_sent: through a hole punched in two NAT routers
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
