// The links of one member of a group (the replicas of a stage, say) to the
// others: its addresses published in the run's store for them to find, and
// the link held to each peer, reused while both ends hold the same one
// (the link's id, which each end announces before an exchange) and opened
// anew otherwise.
#pragma once
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>

#include "comm/link/link_endpoint.h"
#include "comm/store/store.h"

namespace noloco {

class LinkBook {
 public:
  // Publishes `self`'s addresses under the run's `token` in `store`.
  LinkBook(StorePtr store, const std::string& token, LinkEnd self, std::shared_ptr<LinkEndpoint> endpoint);
  ~LinkBook();
  LinkBook(const LinkBook&) = delete;
  LinkBook& operator=(const LinkBook&) = delete;

  const LinkEnd& self() const { return self_; }
  // The id of the link held to `peer` (0: none), to announce.
  int64_t held(const LinkEnd& peer) const;
  // The link to `peer`: the one held if `theirs` (the id the peer announced)
  // names it, else a new one (see LinkEndpoint::open). Null, with `problem`, if none came.
  LinkPtr link_to(const LinkEnd& peer, int64_t theirs, const std::string& attempt, Clock::time_point deadline,
                  const std::function<bool()>& abandon, std::string* problem);
  // After a failure: the link is closed and never used again.
  void forget(const LinkEnd& peer);
  // The newest incarnation of member `rank` that published its addresses in
  // this scope, waiting for one until `deadline` or `abandon()` (asked every
  // 50 ms); -1 if none did.
  int incarnation_of(int rank, Clock::time_point deadline, const std::function<bool()>& abandon) const;
  // Each peer's link's route now, by rank (the live page and the summary show them).
  std::map<int, LinkRoute> routes() const;
  // The relays (host:port) its links went through so far.
  std::set<std::string> relays_used() const;

 private:
  std::optional<LinkAddresses> addresses_of(const LinkEnd& peer, Clock::time_point deadline,
                                           const std::function<bool()>& abandon) const;

  StorePtr book_;  // one connection, one caller at a time (store_mutex_)
  mutable std::mutex store_mutex_;
  LinkEnd self_;
  std::shared_ptr<LinkEndpoint> endpoint_;
  mutable std::mutex mutex_;
  std::map<LinkEnd, LinkPtr> held_;
  std::set<std::string> relays_used_;
};

}  // namespace noloco
