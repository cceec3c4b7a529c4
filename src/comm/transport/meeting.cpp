#include "comm/transport/meeting.h"

#include <fmt/format.h>

#include "comm/transport/ticker.h"

namespace noloco {

namespace {

using Clock = std::chrono::steady_clock;

std::string arrival_key(const std::string& key, int rank) { return fmt::format("{}/here/{}", key, rank); }
std::string link_key(const std::string& key, int from, int to) { return fmt::format("{}/link/{}/{}", key, from, to); }

std::vector<uint8_t> bytes_of(const std::string& s) { return {s.begin(), s.end()}; }

}  // namespace

Meeting::Meeting(std::function<StorePtr()> connect, const std::string& token, const std::string& scope, int self,
                 std::chrono::milliseconds timeout, Liveness* liveness)
    : connect_(std::move(connect)),
      token_(token),
      scope_(scope),
      self_(self),
      timeout_(timeout),
      liveness_(liveness),
      room_(run_scope(connect_(), token_, scope_ + "/meet")) {}

bool Meeting::given_up(int rank, Clock::time_point since) const {
  return liveness_ && liveness_->given_up(rank, since);
}

MeetingOutcome Meeting::meet(const std::string& key, const std::vector<Peer>& peers,
                             const std::map<int, int64_t>& mine) {
  MeetingOutcome out;
  const bool patient = liveness_ != nullptr;
  auto here = [&](int r) { return arrival_key(key, r); };
  for (const auto& peer : peers) {
    const auto it = mine.find(peer.rank);
    room_->set(link_key(key, self_, peer.rank), bytes_of(std::to_string(it == mine.end() ? 0 : it->second)));
  }
  // Given up by a peer before it came: it goes on alone, blaming nobody.
  if (room_->add(here(self_), int64_t(Arrival::came)) != int64_t(Arrival::came)) return out;
  std::vector<std::string> keys;
  for (const auto& peer : peers) keys.push_back(here(peer.rank));
  if (!room_->check(keys)) {
    if (!watch_) watch_ = run_scope(connect_(), token_, scope_ + "/meet");
    const auto start = Clock::now(), deadline = start + timeout_;
    auto noted = start;
    Ticker watchdog(std::chrono::milliseconds(20), [&] {
      for (const auto& peer : peers) {
        if (((!patient && Clock::now() > deadline) || given_up(peer.rank, start)) && !watch_->check({here(peer.rank)}))
          watch_->add(here(peer.rank), int64_t(Arrival::given_up));
      }
      if (patient && Clock::now() - noted > std::chrono::seconds(1)) {
        liveness_->progressed();
        noted = Clock::now();
      }
      return false;
    });
    for (;;) {
      try {
        room_->wait(keys, timeout_ + std::chrono::seconds(30));
        break;
      } catch (const std::exception&) {
        if (!patient) throw;
        if (room_->check(keys)) break;  // else the peers are behind and moving: wait on
      }
    }
  }
  for (const auto& peer : peers) {
    const auto counter = room_->add(here(peer.rank), 0);
    if (counter >= int64_t(Arrival::stays_away)) {
      out.declined.push_back(peer.rank);
    } else if (counter != int64_t(Arrival::came)) {
      out.late.push_back(peer.rank);
    } else if (!room_->check({link_key(key, peer.rank, self_)})) {
      out.declined.push_back(peer.rank);  // it came to meet others, not this member
    } else {
      out.present.push_back(peer);
      const auto value = room_->get(link_key(key, peer.rank, self_));
      out.theirs[peer.rank] = std::stoll(std::string(value.begin(), value.end()));
    }
  }
  return out;
}

void Meeting::stay_away(const std::string& key) { room_->add(arrival_key(key, self_), int64_t(Arrival::stays_away)); }

}  // namespace noloco
