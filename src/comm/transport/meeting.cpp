#include "comm/transport/meeting.h"

#include <stdexcept>

#include "comm/transport/ticker.h"

namespace noloco {

namespace {

using Clock = std::chrono::steady_clock;

using record::arrival;
using record::arrival_verdict;
using record::held_link;

std::vector<uint8_t> bytes_of(const std::string& s) { return {s.begin(), s.end()}; }

// What a member found on arriving, each followed by its note: the same length, so the note starts at one place.
const std::string kCame = "came:", kAlone = "lone:";

}  // namespace

MeetingProtocol::MeetingProtocol(std::vector<int> peers, Clock::time_point start, std::chrono::milliseconds timeout,
                                 bool patient, std::chrono::milliseconds partner_wait)
    : peers_(std::move(peers)),
      start_(start),
      told_(start),
      timeout_(timeout),
      partner_wait_(partner_wait),
      patient_(patient) {}

void MeetingProtocol::arrived(int64_t own_counter) {
  if (state_ != State::announcing) throw std::logic_error("a member arrives at a meeting once");
  state_ = own_counter == int64_t(Arrival::came) ? State::waiting : State::alone;
}

std::vector<int> MeetingProtocol::overdue(Clock::time_point now, const std::function<bool(int)>& come,
                                          const std::function<bool(int)>& given_up_by_authority) const {
  std::vector<int> out;
  if (state_ != State::waiting) return out;
  const bool waited_enough = (!patient_ && now > start_ + timeout_) ||
                             (partner_wait_.count() > 0 && now > start_ + partner_wait_);
  for (const int peer : peers_)
    if ((waited_enough || given_up_by_authority(peer)) && !come(peer)) out.push_back(peer);
  return out;
}

bool MeetingProtocol::verdict_needed(int64_t counter) const {
  return partner_wait_.count() > 0 && counter == int64_t(Arrival::came) + int64_t(Arrival::given_up);
}

bool MeetingProtocol::tell_waiting(Clock::time_point now) {
  if (!patient_ || state_ != State::waiting || now - told_ <= std::chrono::seconds(1)) return false;
  told_ = now;
  return true;
}

MeetingOutcome MeetingProtocol::decide(const std::vector<Peer>& peers, const std::map<int, Reading>& readings,
                                       const std::function<bool(int)>& given_up_by_authority) {
  if (state_ != State::waiting) throw std::logic_error("a meeting is decided by a member waiting at it");
  state_ = State::met;
  MeetingOutcome out;
  for (const auto& peer : peers) {
    const auto& r = readings.at(peer.rank);
    if (r.counter >= int64_t(Arrival::stays_away)) {
      out.declined.push_back(peer.rank);
    } else if (r.counter != int64_t(Arrival::came) && !(verdict_needed(r.counter) && r.came_first)) {
      const bool lost = partner_wait_.count() == 0 || !given_up_by_authority || given_up_by_authority(peer.rank);
      (lost ? out.late : out.behind).push_back(peer.rank);
    } else if (!r.link_to_me) {
      out.declined.push_back(peer.rank);  // it came to meet others, not this member
    } else {
      out.present.push_back(peer);
      out.theirs[peer.rank] = *r.link_to_me;
    }
  }
  return out;
}

Meeting::Meeting(std::function<StorePtr()> connect, const std::string& token, const std::string& scope, int self,
                 std::chrono::milliseconds timeout, Liveness* liveness)
    : connect_(std::move(connect)),
      token_(token),
      scope_(scope),
      self_(self),
      timeout_(timeout),
      liveness_(liveness),
      room_(run_scope(connect_(), token_, record::meeting(scope_))) {}

MeetingOutcome Meeting::meet(const std::string& key, int64_t exchange, const std::vector<Peer>& peers,
                             const std::map<int, int64_t>& mine, const std::vector<uint8_t>& note,
                             std::chrono::milliseconds partner_wait) {
  const auto start = Clock::now();
  std::vector<int> ranks;
  for (const auto& peer : peers) ranks.push_back(peer.rank);
  MeetingProtocol protocol(ranks, start, timeout_, liveness_ != nullptr, partner_wait);
  auto here = [&](int r) { return arrival(key, r); };
  for (const auto& peer : peers) {
    const auto it = mine.find(peer.rank);
    room_->set(held_link(key, self_, peer.rank), bytes_of(std::to_string(it == mine.end() ? 0 : it->second)));
  }
  const auto own = room_->add(here(self_), int64_t(Arrival::came));
  protocol.arrived(own);
  if (partner_wait.count() > 0) {
    auto verdict = bytes_of(own == int64_t(Arrival::came) ? kCame : kAlone);
    verdict.insert(verdict.end(), note.begin(), note.end());
    room_->set(arrival_verdict(key, self_), verdict);
  }
  // Given up by a peer before it came: it goes on alone, blaming nobody.
  if (protocol.state() == MeetingProtocol::State::alone) {
    MeetingOutcome alone;
    alone.left_behind = true;
    if (partner_wait.count() > 0) alone.notes = notes_of(key, peers);
    return alone;
  }
  std::vector<std::string> keys;
  for (const int r : ranks) keys.push_back(here(r));
  if (!room_->check(keys)) {
    if (!watch_) watch_ = run_scope(connect_(), token_, record::meeting(scope_));
    Ticker watchdog(std::chrono::milliseconds(20), [&] {
      const auto now = Clock::now();
      const auto overdue = protocol.overdue(
          now, [&](int r) { return watch_->check({here(r)}); },
          [&](int r) { return liveness_ && (liveness_->given_up(r, start) || liveness_->went_alone(r, exchange, false)); });
      for (const int r : overdue) watch_->add(here(r), int64_t(Arrival::given_up));
      if (protocol.tell_waiting(now)) liveness_->progressed();
      return false;
    });
    for (;;) {
      try {
        room_->wait(keys, timeout_ + std::chrono::seconds(30));
        break;
      } catch (const std::exception&) {
        if (!liveness_) throw;
        if (room_->check(keys)) break;  // else the peers are behind and moving: wait on
      }
    }
  }
  std::map<int, MeetingProtocol::Reading> readings;
  for (const int r : ranks) {
    auto& reading = readings[r];
    reading.counter = room_->add(here(r), 0);
    if (protocol.verdict_needed(reading.counter)) reading.came_first = came_first(key, r);
    const auto theirs = held_link(key, r, self_);
    if ((reading.counter == int64_t(Arrival::came) || reading.came_first) && room_->check({theirs})) {
      const auto value = room_->get(theirs);
      reading.link_to_me = std::stoll(std::string(value.begin(), value.end()));
    }
  }
  return protocol.decide(peers, readings, [&](int r) { return liveness_ && liveness_->given_up(r, start); });
}

bool Meeting::came_first(const std::string& key, int peer) {
  // It writes what it found as soon as it came: the wait is short, unless it died just then.
  const auto verdict = arrival_verdict(key, peer);
  try {
    room_->wait({verdict}, timeout_);
  } catch (const std::exception&) {
    return false;
  }
  const auto found = room_->get(verdict);
  return std::string(found.begin(), found.begin() + std::min(found.size(), kCame.size())) == kCame;
}

std::map<int, std::vector<uint8_t>> Meeting::notes_of(const std::string& key, const std::vector<Peer>& peers) {
  std::map<int, std::vector<uint8_t>> notes;
  for (const auto& peer : peers) {
    const auto verdict = arrival_verdict(key, peer.rank);
    if (!room_->check({verdict})) continue;  // not come either
    const auto found = room_->get(verdict);
    if (found.size() >= kCame.size() && std::string(found.begin(), found.begin() + kCame.size()) == kCame)
      notes[peer.rank].assign(found.begin() + kCame.size(), found.end());
  }
  return notes;
}

void Meeting::stay_away(const std::string& key) { room_->add(arrival(key, self_), int64_t(Arrival::stays_away)); }

}  // namespace noloco
