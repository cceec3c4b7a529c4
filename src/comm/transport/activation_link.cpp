#include "comm/transport/activation_link.h"

#include <fmt/format.h>

#include "comm/transport/framed.h"
#include "util/error_text.h"
#include "util/log.h"

namespace noloco {

namespace {

using Clock = std::chrono::steady_clock;

}  // namespace

ActivationLink::ActivationLink(const StorePtr& store, const WorkerEnv& env, int stages, int incarnation,
                               const std::string& bind, std::chrono::milliseconds timeout,
                               std::chrono::milliseconds heartbeat_timeout, std::shared_ptr<const Seal> seal)
    : store_(store),
      env_(env),
      stages_(stages),
      self_{env.rank, incarnation},
      timeout_(timeout),
      run_id_(run_id_of(env.token)),
      seal_(std::move(seal)),
      rosters_(store, env.token, stages, env.world / stages, heartbeat_timeout),
      device_(gloo_device(bind)) {}

ActivationLink::~ActivationLink() {
  try {
    finish_sends();
  } catch (const std::exception&) {
    // nothing left to deliver to
  }
}

const Roster& ActivationLink::enter(const std::string& name) {
  roster_ = rosters_.snapshot(name);
  std::vector<Peer> listed;  // global ranks, in rank order
  for (int s = 0; s < stages_; ++s)
    for (const auto& p : roster_->stages[size_t(s)]) listed.push_back({p.rank * stages_ + s, p.incarnation});
  std::sort(listed.begin(), listed.end(), [](const Peer& a, const Peer& b) { return a.rank < b.rank; });
  const auto me = std::find(listed.begin(), listed.end(), self_);
  listed_ = me != listed.end();
  if (!listed_) {
    if (was_listed_ && !leaving_)
      throw std::runtime_error(fmt::format(
          "worker {} was given up by its pipeline neighbours (roster {} leaves it out); it stops so that it can be "
          "restarted",
          self_.rank, name));
    return *roster_;
  }
  was_listed_ = true;
  const bool all_known = std::all_of(listed.begin(), listed.end(), [&](const Peer& p) {
    return std::find(members_.begin(), members_.end(), p) != members_.end();
  });
  if (pg_ && all_known) return *roster_;
  // Everyone listed reaches this roster (finishing the step before needs
  // nothing of the step after), so forming the group here cannot deadlock.
  finish_sends();
  if (pg_) retired_.push_back(std::move(pg_));
  pg_ = join_gloo_group(store_, env_, "pipeline/" + name, int(me - listed.begin()), int(listed.size()), device_,
                        timeout_, seal_.get());
  members_ = listed;
  lost_.clear();
  sent_to_.assign(listed.size(), 0);
  received_from_.assign(listed.size(), 0);
  return *roster_;
}

int ActivationLink::member_of(int peer) const {
  if (lost_.count(peer)) return -1;
  for (size_t i = 0; i < members_.size(); ++i)
    if (members_[i].rank == peer) return int(i);
  return -1;
}

void ActivationLink::lose(int peer, const std::string& why) {
  const int member = member_of(peer);
  if (member < 0) return;
  spdlog::warn("lost pipeline worker {}: {}", peer, why);
  lost_.insert(peer);
  stats_.peers_lost += 1;
  rosters_.declare_dead(peer);
}

int ActivationLink::next_tag(std::vector<int64_t>& counters, int member) {
  constexpr int kTags = framed_tags(2);  // a pipeline message carries at most two tensors
  return int((counters[size_t(member)]++ % (1 << 28)) * kTags);
}

MessageHeader ActivationLink::header_of(const ActivationHeader& h, const std::vector<torch::Tensor>& tensors) const {
  MessageHeader m;
  m.run = run_id_;
  m.kind = int64_t(h.kind);
  m.exchange = h.step;
  m.micro = h.micro;
  m.boundary = h.boundary;
  m.origin = h.origin;
  for (const auto& t : tensors) m.bytes += int64_t(t.numel()) * int64_t(t.element_size());
  return m;
}

void ActivationLink::post(int peer, const MessageHeader& header, std::vector<torch::Tensor> payload, bool evaluation) {
  const int member = member_of(peer);
  if (member < 0) return;  // lost: what it would have received is dropped at its other neighbours
  const int tag = next_tag(sent_to_, member);
  std::shared_ptr<FramedSend> send;
  try {
    send = std::make_shared<FramedSend>(*pg_, member, tag, header, std::move(payload), seal_.get());
  } catch (const std::exception& e) {
    lose(peer, error_text(e));
    return;
  }
  (evaluation ? stats_.evaluation_bytes_sent : stats_.bytes_sent) += send->payload_bytes();
  if (!evaluation) stats_.messages += 1;
  pending_.push_back({peer, [send, timeout = timeout_] { send->wait(timeout); }});
}

void ActivationLink::send(int peer, const ActivationHeader& header, const std::vector<torch::Tensor>& tensors,
                          int64_t format) {
  TORCH_CHECK(tensors.size() <= 2, "a pipeline message carries at most two tensors");
  std::vector<torch::Tensor> payload;
  for (const auto& t : tensors) payload.push_back(t.detach().to(torch::kCPU).contiguous());
  auto announced = header_of(header, payload);
  announced.format = format;
  post(peer, announced, std::move(payload), header.kind == MessageKind::evaluation);
}

void ActivationLink::send_dropped(int peer, const ActivationHeader& header) {
  post(peer, dropped_notice(header_of(header, {})), {}, header.kind == MessageKind::evaluation);
}

bool ActivationLink::recv(int peer, const ActivationHeader& expected, std::vector<torch::Tensor>& tensors,
                          int64_t format) {
  const bool evaluation = expected.kind == MessageKind::evaluation;
  const int member = member_of(peer);
  if (member < 0) {
    if (!evaluation) stats_.micro_batches_dropped += 1;
    return false;
  }
  const int tag = next_tag(received_from_, member);
  const auto start = Clock::now();
  auto dropped = [&] {
    if (!evaluation) {
      stats_.micro_batches_dropped += 1;
      stats_.idle_seconds += std::chrono::duration<double>(Clock::now() - start).count();
    }
    return false;
  };
  auto lost = [&](const std::string& why) {
    lose(peer, fmt::format("no {} (step {}, micro-batch {}): {}", message_kind_name(int64_t(expected.kind)),
                           expected.step, expected.micro, why));
    return dropped();
  };
  if (rosters_.given_up(peer, start)) return lost("given up (declared dead, lost by a neighbour, or silent)");
  // Header first: a dropped notice may come instead, and the payload is only
  // received into buffers of the size the header was checked to announce.
  auto announced = header_of(expected, tensors);
  announced.format = format;
  std::optional<FramedReceive> in;
  try {
    in.emplace(*pg_, member, tag, announced, tensors, /*eager=*/false, seal_.get());
  } catch (const std::exception& e) {
    return lost(error_text(e));
  }
  switch (in->wait(timeout_)) {
    case Delivery::received: break;
    case Delivery::dropped: return dropped();
    case Delivery::rejected:
      throw std::runtime_error(fmt::format("rejected a pipeline message from worker {}: {}", peer, in->problem()));
    case Delivery::unauthentic:
      spdlog::error("a pipeline message from worker {} failed authentication: not used", peer);
      return lost(in->problem());
    case Delivery::peer_lost: return lost(in->problem());
  }
  if (!evaluation)
    for (const auto& t : tensors) stats_.bytes_received += t.nbytes();  // what crossed the wire, decodable or not
  if (!evaluation) stats_.idle_seconds += std::chrono::duration<double>(Clock::now() - start).count();
  return true;
}

void ActivationLink::finish_sends() {
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
