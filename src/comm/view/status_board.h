// The run's live status (issue 68). Each worker that speaks for its replica
// publishes, into the run's store, what somebody watching the run wants to
// see: its step, losses, throughput, bytes, last partner and state, and the
// points of its curves (validation losses, pairings, joins and leaves). Every
// entry is sealed with the run's key (comm/transport/seal.h), so that whoever
// reads the store without the token (a torchrun TCPStore has no password)
// reads nothing of it. `noloco watch` and `noloco serve` read the entries back
// (StatusReader) and serve them as a page (comm/view/view_server.h).
//
// The store's layout, under run_scope(token, "status"):
//   members      the ranks of the workers that publish (a comma list)
//   changes      a counter each publisher adds 1 to after each entry, so that
//                one read tells a watcher whether there is anything new
//   <rank>/last  the number of that worker's newest entry
//   <rank>/<n>   entry n (sealed JSON); the newest kStatusEntriesKept are kept
//   watchers     the ids of the watchers reading the run (a comma list), and
//   watcher/<id> the `changes` each has read up to: a launcher about to
//                take its store down lets them read the run's last entries
#pragma once
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "comm/store/store.h"

namespace noloco {

class Seal;

constexpr int64_t kStatusEntriesKept = 2048;
// An entry's plain JSON at most; points that do not fit wait for the next one.
constexpr size_t kStatusEntryBytes = 4096;

// Folds one telemetry record (train, val, outer, join, rejoin, donate) into
// a worker's `status`, appending to `points` what a curve, the pairing graph
// or the timeline keeps. Pure: the publisher's logic, apart from the store.
void fold_record(nlohmann::json& status, std::vector<nlohmann::json>& points, const nlohmann::json& record);

class StatusPublisher {
 public:
  // `identity` (rank, replica, stage, stages, machine, incarnation) heads
  // every entry. At most one entry per `interval` (validation points, events
  // and the end at once), written on a thread of the publisher's own: a slow
  // or unreachable store never holds up training, and records that pile up
  // meanwhile go out together.
  StatusPublisher(StorePtr store, const std::string& token, nlohmann::json identity,
                  std::chrono::milliseconds interval = std::chrono::seconds(1));
  // Publishes what is pending (at most one store call's wait), then stops.
  ~StatusPublisher();
  StatusPublisher(const StatusPublisher&) = delete;
  StatusPublisher& operator=(const StatusPublisher&) = delete;

  void record(const nlohmann::json& r);
  // The last two (finished, left) are published at once.
  void set_state(record::WorkerState state);
  // Returns once what is pending has been written (or one attempt failed;
  // at most `limit`): before a worker tells the run it has finished, after
  // which the store may go.
  void flush(std::chrono::milliseconds limit = std::chrono::seconds(10));

 private:
  void run();
  void publish(const nlohmann::json& status, std::vector<nlohmann::json>& points);

  const StorePtr store_;
  const std::unique_ptr<Seal> seal_;
  const int rank_;
  const std::chrono::milliseconds interval_;
  int64_t number_ = 0;  // of the last entry written (the writer thread's)
  std::mutex mutex_;
  std::condition_variable wake_;
  nlohmann::json status_;                // under mutex_
  std::vector<nlohmann::json> points_;   // under mutex_: not yet published
  bool changed_ = false, urgent_ = false, stopping_ = false, writing_ = false;
  int64_t attempts_ = 0;  // entries the writer has tried to write
  std::thread writer_;
};

// A watcher's side: the entries published since it last asked.
struct StatusEntry {
  int rank = 0;
  int64_t number = 0;
  nlohmann::json body;  // {"status": {...}, "points": [...]}
};

class StatusReader {
 public:
  explicit StatusReader(const std::string& token);
  ~StatusReader();
  // New entries in `scope` (run_scope(token, "status") of the run's store,
  // which may be a new connection each time), each member's in order. Where
  // more than kStatusEntriesKept were published since the last poll, the
  // older ones are gone from the store and skipped. Throws what the store
  // throws (it is gone).
  std::vector<StatusEntry> poll(c10d::Store& scope);
  // Entries that failed to open with the run's key or to parse.
  int64_t refused() const { return refused_; }

 private:
  const std::unique_ptr<Seal> seal_;
  const std::string id_;  // this watcher's, in `watchers`
  bool listed_ = false;
  std::string changes_seen_ = "none yet";  // the marker of the last change it read up to
  std::map<int, int64_t> read_up_to_;  // by rank
  int64_t refused_ = 0;
};

// Before a store that holds `scope` goes away with its run (a launcher's):
// waits until every watcher has read the last entries, up to `limit` (a
// watcher that has gone costs the limit).
void let_watchers_catch_up(c10d::Store& scope, std::chrono::milliseconds limit);

// The seal's associated data of entry `number` of worker `rank`: an entry moved under another key fails to open.
std::vector<uint8_t> status_entry_context(int rank, int64_t number);

}  // namespace noloco
