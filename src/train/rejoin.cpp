#include "train/rejoin.h"

#include <algorithm>
#include <chrono>

#include <fmt/format.h>

#include "comm/store/store_outage.h"
#include "util/error_text.h"
#include "util/log.h"

namespace noloco {

namespace {

// The hand-over's payload format: a safetensors buffer (the earlier packed layout had 0).
constexpr int64_t kStateFormat = 1;

MessageHeader state_header(int64_t bytes) {
  MessageHeader h;
  h.kind = int64_t(MessageKind::state);
  h.bytes = bytes;
  h.format = kStateFormat;
  return h;
}

}  // namespace

std::chrono::milliseconds rejoin_timeout(const CommConfig& comm) {
  return std::max(std::chrono::milliseconds(int64_t(comm.peer_timeout * 1000)), std::chrono::milliseconds(600000));
}

Rejoined rejoin_from_peer(Membership& membership, Transport& transport, const TrainingState& state,
                          std::chrono::milliseconds timeout, const FailureDrill& drill) {
  const auto start = std::chrono::steady_clock::now();
  Rejoined r;
  r.donor = membership.request_state(timeout);
  drill.during_handover();
  const auto bytes =
      transport.receive_state(membership.handover_channel(), r.donor, state_header(0), training_state_max_bytes(state));
  r.step = deserialize_training_state(bytes, state);
  membership.rejoined();
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return r;
}

int64_t share_state_within_replica(Collectives& replica, const TrainingState& state, int64_t step) {
  const bool first = replica.rank() == 0;
  auto bytes = first ? serialize_training_state(state, step) : torch::Tensor();
  // The others size their buffer from the first's. Their own state is the
  // weights and AdamW's two moments; the first's adds the outer state (φ,
  // momentum, residuals, an exchange in flight: at most six more copies of
  // the weights), so three times theirs bounds it.
  auto size = torch::full({1}, first ? bytes.numel() : int64_t(0), torch::kInt64);
  replica.broadcast(size, 0);
  if (!first) {
    const int64_t n = size.item<int64_t>();
    if (n <= 0 || n > 3 * training_state_max_bytes(state))
      throw std::runtime_error(fmt::format("the replica's first worker announced a state of {} bytes", n));
    bytes = torch::empty({n}, torch::kUInt8);
  }
  replica.broadcast(bytes, 0);
  return first ? step : deserialize_training_state(bytes, state);
}

HandOvers serve_rejoins(Membership& membership, Transport& transport, const TrainingState& state, int64_t step) {
  HandOvers done;
  std::vector<std::pair<int, std::string>> requests;
  try {
    // A request waits in the store: served at the first outer step after an outage.
    if (!store_outage().ongoing()) requests = membership.claim_requests(step);
  } catch (const StoreUnreachable&) {
  }
  for (const auto& [who, channel] : requests) {
    try {
      const auto bytes = serialize_training_state(state, step);
      transport.send_state(channel, who, state_header(bytes.numel()), bytes);
      done.served.push_back(who);
    } catch (const std::exception& e) {
      spdlog::warn("could not hand over state to replica {}: {}", who, error_text(e));
      // It cannot go on without the state: not counted live (a joiner's stage is chosen by who is).
      membership.declare_dead(who);
      done.abandoned.push_back(who);
    }
  }
  return done;
}

}  // namespace noloco
