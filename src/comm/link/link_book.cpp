#include "comm/link/link_book.h"

#include <fmt/format.h>

namespace noloco {

namespace {

std::string record_key(const LinkEnd& end) { return fmt::format("{}.{}", end.rank, end.incarnation); }

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
    : book_(run_scope(store, token, "links/" + self.scope)), self_(std::move(self)), endpoint_(std::move(endpoint)) {
  endpoint_->serve(self_);
  const auto record = record_of(endpoint_->addresses());
  book_->set(record_key(self_), std::vector<uint8_t>(record.begin(), record.end()));
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

LinkAddresses LinkBook::addresses_of(const LinkEnd& peer) const {
  const auto key = record_key(peer);
  if (!book_->check({key})) return {};
  const auto value = book_->get(key);
  return parse_record(std::string(value.begin(), value.end()));
}

LinkPtr LinkBook::link_to(const LinkEnd& peer, int64_t theirs, const std::string& attempt, Clock::time_point deadline,
                          const std::function<bool()>& abandon, std::string* problem) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    const auto it = held_.find(peer);
    if (it != held_.end() && !it->second->broken() && it->second->id() == theirs) return it->second;
  }
  forget(peer);
  auto link = endpoint_->open(self_, peer, addresses_of(peer), attempt, deadline, abandon, problem);
  if (link) {
    std::lock_guard<std::mutex> lock(mutex_);
    held_[peer] = link;
  }
  return link;
}

}  // namespace noloco
