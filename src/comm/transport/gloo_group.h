// Forming a Gloo process group that only members are in: a replica's own
// workers, on one site's network (between sites, links: comm/link/).
//
// LibTorch 2.x's Gloo listens on one port per device, and a connection says
// which pair it is for by the sequence number it sends first; the first
// connection with a number wins. The numbers are small (a fresh device counts
// from 0), so a stranger who finds the port can take a pair: both members
// then believe they are connected, and every exchange on the group would wait
// out peer_timeout. So a new group is only used once every member has heard
// an authenticated greeting from every other over its own pair, and all have
// said so in the store. Once every member has said it is connected, the
// greetings must come within kGreetingGrace; otherwise the group is thrown
// away (which closes the stranger's connections) and formed again on a fresh
// device, within the same overall timeout. The greeting costs one small
// message per pair direction, once per group (a replica's group is formed
// once).
#pragma once
#include <sys/socket.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "comm/store/store.h"
#include "config/worker_env.h"

namespace c10d {
class ProcessGroupGloo;
}  // namespace c10d

namespace noloco {

class Seal;

using GlooGroup = c10::intrusive_ptr<c10d::ProcessGroupGloo>;

// A Gloo process group of `world` members named `name` in the run's store,
// listening on `bind`, every pair of it checked to reach the member it
// should (greetings sealed with `seal`, or in clear when null). Throws with a
// message that names the likely cause (token, dead workers, a stranger on
// every try), at once if `abandon` (when given) says a member is gone, else
// within `timeout`.
GlooGroup join_gloo_group(const StorePtr& store, const WorkerEnv& env, const std::string& name, int rank, int world,
                          const std::string& bind, std::chrono::milliseconds timeout, const Seal* seal,
                          const std::function<bool()>& abandon = nullptr);

// How many times a group is formed before join_gloo_group gives up on it.
constexpr int kGroupAttempts = 16;

// How long greetings may take once every member is connected: they are a few
// bytes each over pairs already open inside one site.
constexpr std::chrono::seconds kGreetingGrace{5};

// What a member published in a try's rendezvous (Gloo's key "0/<member>",
// device 0): its device's listening address and the sequence number that a
// connection from each peer sends there.
struct GlooRendezvousEntry {
  sockaddr_storage listener{};
  std::vector<int64_t> sequence;  // by peer; empty when Gloo numbers pairs by rank

  int64_t sequence_from(int peer) const { return sequence.empty() ? peer : sequence.at(size_t(peer)); }
};

// Reads Gloo's record (hostname, device address, pair numbers); nullopt for
// anything else.
std::optional<GlooRendezvousEntry> parse_gloo_rendezvous_entry(const std::vector<uint8_t>& bytes, int world);

}  // namespace noloco
