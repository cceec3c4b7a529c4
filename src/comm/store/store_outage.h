// The run's store not answering (its host died, its network is down, a
// serve being restarted) is not the run's end: each worker trains on alone
// and asks again, and ends only once the outage outlasts its bound
// (comm.store_outage). Every store connection of the process tells the one
// StoreOutage what it met, so that the training loop, the heartbeat and the
// liveness checks share one view of it. Thread-safe.
#pragma once
#include <chrono>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>

namespace noloco {

// A request the store could not be reached for (refused, reset, timed out):
// unlike a refusal (a wrong token) it may go through later.
class StoreUnreachable : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// The store answered and refused this worker: it holds another run's key, or
// refused the password the token gives. Waiting does not help.
class StoreRefused : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class StoreOutage {
 public:
  using Clock = std::chrono::steady_clock;

  // A request failed for want of the store; `why` names the store and the failure.
  void unreachable(const std::string& why);
  // A request was answered.
  void reached();
  // Whether the last request failed for want of the store.
  bool ongoing() const;
  // Whether any request of this process was answered: after that, a store
  // with another key at the run's address is something else answering there
  // during an outage (a serve restarted with a new token), not a wrong token.
  bool ever_reached() const;
  // How long the store has not answered (zero while it does).
  std::chrono::duration<double> seconds() const;
  // The failure that began the outage under way (empty while the store answers).
  std::string why() const;
  // When the last outage ended (none yet: the clock's zero). Silence that
  // spans an outage is the store's, not a member's: liveness counts from here.
  Clock::time_point last_ended() const;
  // How long the last outage that ended lasted.
  double last_seconds() const;
  // Outages over so far and their total length: for the summary.
  int count() const;
  double total_seconds() const;

 private:
  mutable std::mutex mutex_;
  std::optional<Clock::time_point> since_;
  bool ever_reached_ = false;
  std::string why_;
  Clock::time_point last_ended_{};
  double last_seconds_ = 0;
  int count_ = 0;
  double total_seconds_ = 0;
};

// This process's.
StoreOutage& store_outage();

}  // namespace noloco
