#include "comm/transport/peer_link.h"

#include <algorithm>

#include <fmt/format.h>

#include "comm/store/run_keys.h"
#include "util/leave_signal.h"
#include "util/log.h"

namespace noloco {

namespace {

uint8_t* bytes_ptr(const torch::Tensor& t) { return static_cast<uint8_t*>(t.data_ptr()); }

}  // namespace

PeerLink::PeerLink(std::string peers_name, StorePtr store, const WorkerEnv& env, Peer self,
                   std::shared_ptr<LinkEndpoint> endpoint, std::chrono::milliseconds timeout, Liveness& liveness)
    : peers_name_(std::move(peers_name)),
      self_(self),
      timeout_(timeout),
      run_id_(run_id_of(env.token)),
      liveness_(liveness),
      book_(std::move(store), env.token, {record::kPipelineBook, self.rank, self.incarnation}, std::move(endpoint)) {}

PeerLink::~PeerLink() {
  try {
    finish_sends();
  } catch (const std::exception&) {
    // nothing left to deliver to
  }
}

void PeerLink::form(const std::string& name, const std::vector<Peer>& members) {
  const bool all_known = !members_.empty() && std::all_of(members.begin(), members.end(), [&](const Peer& p) {
    return std::find(members_.begin(), members_.end(), p) != members_.end();
  });
  if (all_known) return;
  finish_sends();
  for (const auto& p : members_)
    if (std::find(members.begin(), members.end(), p) == members.end()) book_.forget({record::kPipelineBook, p.rank, p.incarnation});
  members_ = members;
  name_ = "pipeline/" + name;
  lost_.clear();
}

const Peer* PeerLink::member(int peer) const {
  if (lost_.count(peer)) return nullptr;
  const auto it = std::find_if(members_.begin(), members_.end(), [&](const Peer& p) { return p.rank == peer; });
  return it == members_.end() ? nullptr : &*it;
}

LinkPtr PeerLink::link_of(const Peer& peer, std::string* problem) {
  std::mutex* opening = nullptr;
  {
    std::lock_guard<std::mutex> lock(open_mutex_);
    auto& m = opening_[peer.rank];
    if (!m) m = std::make_unique<std::mutex>();
    opening = m.get();
  }
  std::lock_guard<std::mutex> lock(*opening);
  const LinkEnd end{record::kPipelineBook, peer.rank, peer.incarnation};
  const int64_t held = book_.held(end);
  // A peer that died before its link opened is not waited for: the
  // authority reads its verdicts afresh for each roster, so a restarted
  // worker the roster lists is not given up for its old incarnation.
  return book_.link_to(end, held, name_, Clock::now() + timeout_,
                       [&] { return liveness_.given_up(peer.rank, Clock::now()); }, problem);
}

void PeerLink::lose(int peer, const std::string& why) {
  const Peer* p = member(peer);
  if (!p) return;
  spdlog::warn("lost {} {}: {}", peers_name_, peer, why);
  book_.forget({record::kPipelineBook, p->rank, p->incarnation});
  lost_.insert(peer);
  peers_lost_ += 1;
  // A worker leaving the run (SIGTERM) blames nobody for its last sends.
  if (!leave_requested()) liveness_.declare_dead(peer);
}

bool PeerLink::send(int peer, const MessageHeader& header, std::vector<torch::Tensor> parts) {
  TORCH_CHECK(parts.size() <= size_t(kMaxParts), "a peer message carries at most two parts");
  const Peer* p = member(peer);
  if (!p) return false;  // lost: what it would have received is dropped at its other neighbours
  auto before = sending_[peer];
  sending_[peer] = std::async(std::launch::async, [this, to = *p, header, parts = std::move(parts), before]() {
                     if (before.valid() && !before.get().empty()) return std::string("an earlier message failed");
                     std::string problem;
                     const auto link = link_of(to, &problem);
                     if (!link) return problem;
                     std::vector<Link::Part> payload;
                     for (const auto& t : parts) payload.push_back({bytes_ptr(t), size_t(t.nbytes())});
                     if (!send_message(*link, header, payload, Clock::now() + timeout_)) return link->problem();
                     if (header.kind != int64_t(MessageKind::evaluation)) {
                       if (link->route() == LinkRoute::relayed) relayed_bytes_ += uint64_t(header.bytes);
                       if (link->route() == LinkRoute::punched) punched_bytes_ += uint64_t(header.bytes);
                     }
                     return std::string();
                   }).share();
  return true;
}

Delivery PeerLink::receive(int peer, const MessageHeader& expected, std::vector<torch::Tensor>& parts,
                           std::string& problem) {
  const Peer* p = member(peer);
  if (!p) {
    problem = "lost before";
    return Delivery::peer_lost;
  }
  // Over a link already open, what the peer sent before it left (SIGTERM)
  // or died is still read: its end closes after its last message.
  const LinkEnd end{record::kPipelineBook, p->rank, p->incarnation};
  if (book_.held(end) == 0 && liveness_.given_up(peer, std::chrono::steady_clock::now())) {
    problem = "given up (declared dead, lost by a neighbour, or silent)";
    return Delivery::peer_lost;
  }
  const auto link = link_of(*p, &problem);
  if (!link) return Delivery::peer_lost;
  // Header first: a dropped notice may come instead, and the payload only
  // lands in buffers of the size the header was checked to announce.
  const auto in = receive_message(
      *link, expected,
      [&](const MessageHeader&) {
        std::vector<Link::Slot> slots;
        for (auto& t : parts) slots.push_back({bytes_ptr(t), size_t(t.nbytes())});
        return slots;
      },
      Clock::now() + timeout_, /*dropped_ok=*/true);
  if (in.delivery != Delivery::received && in.delivery != Delivery::dropped) problem = in.problem;
  if (in.delivery == Delivery::unauthentic)
    spdlog::error("a message from {} {} failed authentication: not used", peers_name_, peer);
  return in.delivery;
}

void PeerLink::finish_sends() {
  auto sending = std::move(sending_);
  sending_.clear();
  for (auto& [peer, last] : sending) {
    const auto problem = last.get();
    if (!problem.empty()) lose(peer, problem);
  }
}

}  // namespace noloco
