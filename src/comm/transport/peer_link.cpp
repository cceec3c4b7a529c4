#include "comm/transport/peer_link.h"

#include <algorithm>
#include <optional>

#include <fmt/format.h>

#include "comm/store/run_keys.h"
#include "util/error_text.h"
#include "util/log.h"

namespace noloco {

PeerLink::PeerLink(std::string peers_name, StorePtr store, const WorkerEnv& env, Peer self, const std::string& bind,
                   std::chrono::milliseconds timeout, std::shared_ptr<const Seal> seal, Liveness& liveness)
    : peers_name_(std::move(peers_name)),
      store_(std::move(store)),
      env_(env),
      self_(self),
      timeout_(timeout),
      run_id_(run_id_of(env.token)),
      seal_(std::move(seal)),
      liveness_(liveness),
      device_(gloo_device(bind)) {}

PeerLink::~PeerLink() {
  try {
    finish_sends();
  } catch (const std::exception&) {
    // nothing left to deliver to
  }
}

void PeerLink::form(const std::string& name, const std::vector<Peer>& members) {
  const bool all_known = std::all_of(members.begin(), members.end(), [&](const Peer& p) {
    return std::find(members_.begin(), members_.end(), p) != members_.end();
  });
  if (group_ && all_known) return;
  const auto me = std::find(members.begin(), members.end(), self_);
  finish_sends();
  if (group_) retired_.push_back(std::move(group_));
  group_ = join_gloo_group(store_, env_, "pipeline/" + name, int(me - members.begin()), int(members.size()), device_,
                           timeout_, seal_.get(), nullptr, &routes_);
  members_ = members;
  lost_.clear();
  sent_to_.assign(members.size(), 0);
  received_from_.assign(members.size(), 0);
}

int PeerLink::member_of(int peer) const {
  if (lost_.count(peer)) return -1;
  for (size_t i = 0; i < members_.size(); ++i)
    if (members_[i].rank == peer) return int(i);
  return -1;
}

bool PeerLink::relayed(int peer) const {
  const int member = member_of(peer);
  return member >= 0 && routes_.relayed_with(member);
}

int PeerLink::next_tag(std::vector<int64_t>& counters, int member) const {
  constexpr int kTags = framed_tags(kMaxParts);
  return int((counters[size_t(member)]++ % (1 << 28)) * kTags);
}

void PeerLink::lose(int peer, const std::string& why) {
  if (member_of(peer) < 0) return;
  spdlog::warn("lost {} {}: {}", peers_name_, peer, why);
  lost_.insert(peer);
  peers_lost_ += 1;
  liveness_.declare_dead(peer);
}

bool PeerLink::send(int peer, const MessageHeader& header, std::vector<torch::Tensor> parts) {
  TORCH_CHECK(parts.size() <= size_t(kMaxParts), "a peer message carries at most two parts");
  const int member = member_of(peer);
  if (member < 0) return false;  // lost: what it would have received is dropped at its other neighbours
  const int tag = next_tag(sent_to_, member);
  std::shared_ptr<FramedSend> framed;
  try {
    framed = std::make_shared<FramedSend>(*group_, member, tag, header, std::move(parts), seal_.get());
  } catch (const std::exception& e) {
    lose(peer, error_text(e));
    return false;
  }
  pending_.push_back({peer, [framed, timeout = timeout_] { framed->wait(timeout); }});
  return true;
}

Delivery PeerLink::receive(int peer, const MessageHeader& expected, std::vector<torch::Tensor>& parts,
                           std::string& problem) {
  const int member = member_of(peer);
  if (member < 0) {
    problem = "lost before";
    return Delivery::peer_lost;
  }
  const int tag = next_tag(received_from_, member);
  if (liveness_.given_up(peer, std::chrono::steady_clock::now())) {
    problem = "given up (declared dead, lost by a neighbour, or silent)";
    return Delivery::peer_lost;
  }
  // Header first: a dropped notice may come instead, and the payload is only
  // received into buffers of the size the header was checked to announce.
  std::optional<FramedReceive> in;
  try {
    in.emplace(*group_, member, tag, expected, parts, /*eager=*/false, seal_.get());
  } catch (const std::exception& e) {
    problem = error_text(e);
    return Delivery::peer_lost;
  }
  const auto delivery = in->wait(timeout_);
  if (delivery != Delivery::received && delivery != Delivery::dropped) problem = in->problem();
  if (delivery == Delivery::unauthentic)
    spdlog::error("a message from {} {} failed authentication: not used", peers_name_, peer);
  return delivery;
}

void PeerLink::finish_sends() {
  auto pending = std::move(pending_);
  pending_.clear();
  for (auto& p : pending) {
    try {
      p.wait();
    } catch (const std::exception& e) {
      lose(p.peer, error_text(e));
    }
  }
}

}  // namespace noloco
