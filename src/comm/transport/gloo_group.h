// Forming a Gloo process group that only members are in: a replica's own
// workers, on one site's network (between sites, links: comm/link/).
//
// The Gloo of LibTorch 1.13 (Debian's, 2022) listens on a fresh port for each
// pair of a new group and takes the first connection that arrives as the
// peer. A stranger who connects first (a port scan is enough) is then a
// "member" that never answers: every exchange on that group waited out
// peer_timeout and was lost. So a new group is only used once every member
// has heard an authenticated greeting from every other over its own pair,
// and all have said so in the store; otherwise it is thrown away (which
// closes the stranger's connection) and formed again on fresh ports, within
// the same overall timeout. The greeting costs one small message per pair
// direction, once per group (a replica's group is formed once).
#pragma once
#include <chrono>
#include <functional>
#include <memory>
#include <string>

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

}  // namespace noloco
