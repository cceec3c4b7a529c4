#include "comm/link/link_book.h"

#include <thread>

#include <fmt/format.h>

namespace noloco {

namespace {

std::string record_key(const LinkEnd& end) { return record::link_record(end.rank, end.incarnation); }

std::string record_of(const LinkAddresses& a) {
  return fmt::format("{}|{}|{}", a.listen, a.reflexive, a.reachable ? 1 : 0);
}

LinkAddresses parse_record(const std::string& text) {
  LinkAddresses a;
  const auto first = text.find('|'), second = text.find('|', first + 1);
  if (first == std::string::npos || second == std::string::npos) return a;
  a.listen = text.substr(0, first);
  a.reflexive = text.substr(first + 1, second - first - 1);
  a.reachable = text.substr(second + 1) == "1";
  return a;
}

}  // namespace

LinkBook::LinkBook(StorePtr store, const std::string& token, LinkEnd self, std::shared_ptr<LinkEndpoint> endpoint)
    : book_(run_scope(store, token, record::link_book(self.scope))), self_(std::move(self)), endpoint_(std::move(endpoint)) {
  endpoint_->serve(self_);
  const auto record = record_of(endpoint_->addresses(self_));
  book_->set(record_key(self_), std::vector<uint8_t>(record.begin(), record.end()));
  const auto incarnation = std::to_string(self_.incarnation);
  book_->set(record::latest_incarnation(self_.rank), std::vector<uint8_t>(incarnation.begin(), incarnation.end()));
}

LinkBook::~LinkBook() {
  endpoint_->unserve(self_);
  std::lock_guard<std::mutex> lock(mutex_);
  for (auto& [peer, link] : held_) link->shut();
}

int64_t LinkBook::held(const LinkEnd& peer) const {
  std::lock_guard<std::mutex> lock(mutex_);
  const auto it = held_.find(peer);
  return it == held_.end() || it->second->broken() ? 0 : it->second->id();
}

void LinkBook::forget(const LinkEnd& peer) {
  std::lock_guard<std::mutex> lock(mutex_);
  const auto it = held_.find(peer);
  if (it == held_.end()) return;
  it->second->shut();
  held_.erase(it);
}

std::optional<LinkAddresses> LinkBook::addresses_of(const LinkEnd& peer, Clock::time_point deadline,
                                                   const std::function<bool()>& abandon) const {
  const auto key = record_key(peer);
  for (;;) {
    {
      std::lock_guard<std::mutex> lock(store_mutex_);
      if (book_->check({key})) {
        const auto value = book_->get(key);
        return parse_record(std::string(value.begin(), value.end()));
      }
    }
    if (Clock::now() >= deadline || (abandon && abandon())) return std::nullopt;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

LinkPtr LinkBook::link_to(const LinkEnd& peer, int64_t theirs, const std::string& attempt, Clock::time_point deadline,
                          const std::function<bool()>& abandon, std::string* problem) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    const auto it = held_.find(peer);
    if (it != held_.end() && !it->second->broken() && it->second->id() == theirs) return it->second;
  }
  forget(peer);
  // A peer that has not started yet has published nothing: wait for it.
  const auto theirs_at = addresses_of(peer, deadline, abandon);
  if (!theirs_at) {
    *problem = fmt::format("{} published no addresses (it has not started, or is gone)", peer.name());
    return nullptr;
  }
  auto link = endpoint_->open(self_, peer, *theirs_at, attempt, deadline, abandon, problem);
  if (link) {
    std::lock_guard<std::mutex> lock(mutex_);
    held_[peer] = link;
    if (link->route() == LinkRoute::relayed) relays_used_.insert(link->relay());
  }
  return link;
}

int LinkBook::incarnation_of(int rank, Clock::time_point deadline, const std::function<bool()>& abandon) const {
  const auto key = record::latest_incarnation(rank);
  for (;;) {
    {
      std::lock_guard<std::mutex> lock(store_mutex_);
      if (book_->check({key})) {
        const auto value = book_->get(key);
        return std::stoi(std::string(value.begin(), value.end()));
      }
    }
    if (Clock::now() >= deadline || (abandon && abandon())) return -1;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

std::map<int, LinkRoute> LinkBook::routes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::map<int, LinkRoute> out;
  for (const auto& [peer, link] : held_) out[peer.rank] = link->route();
  return out;
}

std::set<std::string> LinkBook::relays_used() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return relays_used_;
}

}  // namespace noloco
