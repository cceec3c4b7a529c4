// The run's record in its store: every key a run keeps there is spelled in
// this file and nowhere else. All of them live under the run's secret prefix
// (run_scope in comm/store/store.h, "noloco/<prefix>/..."):
//
//   run/config                     the run's config.yaml (first writer wins)
//   resume/steps/<worker>          the checkpoints a worker holds, or kStartsFromPeer
//   heartbeat/<worker>             counters a worker adds to each second ...
//   progress/<worker>              ... and as its training moves (membership/heartbeat.h)
//   <group>/members/...            a group of replicas ("replicas", or "stage<s>" of a pipeline):
//       joiners                    a counter: member ids claimed by joiners
//       joined dead finished lost incarnations rejoin diverged    comma lists
//       started/<m> summary/<m> refused/<m> snapshot/<name> donor/<request>
//   <group>/meet/<key>/here/<m>    an exchange's meeting (comm/transport/meeting.h)
//   <group>/meet/<key>/link/<a>/<b>
//   <group>/formations/<name>/<members>/abandoned
//   links/<book>/...               a book of link addresses (comm/link/link_book.h):
//       <rank>.<incarnation> latest/<rank>
//   pipeline/rosters/<name>        a pipeline's rosters, one per step
//   replica<r>/workers/<life>/...  a replica's own process group (Gloo's or NCCL's keys)
//   <group>/pg/...                 (comm/transport/gloo_group.h):
//       abandoned <try>/verdict/{failed,connected/<m>,ok/<m>} <try>/(Gloo's keys)
//   status/...                     the live status (comm/view/status_board.h):
//       members changes <rank>/last <rank>/<n> watchers watcher/<id>
#pragma once
#include <cstdint>
#include <string>

namespace noloco::record {

inline std::string in(const std::string& scope, const std::string& key) { return scope + "/" + key; }
inline std::string numbered(const std::string& what, int64_t n) { return what + "/" + std::to_string(n); }

// The run as a whole.
inline const std::string kRun = "run";
inline const std::string kConfig = "config";
inline const std::string kResume = "resume";
inline std::string resume_steps(int worker) { return numbered("steps", worker); }
// In place of a worker's list of checkpoints: it starts from a live replica's state.
inline const std::string kStartsFromPeer = "peer";
inline std::string heartbeat(int worker) { return numbered("heartbeat", worker); }
inline std::string progress(int worker) { return numbered("progress", worker); }

// A group of replicas that exchange with each other: all of them, or one
// stage's replicas of a pipeline.
inline std::string replica_group(int stages, int stage) {
  return stages > 1 ? "stage" + std::to_string(stage) : std::string("replicas");
}
inline std::string members(const std::string& group) { return in(group, "members"); }
namespace member {
inline const std::string kJoiners = "joiners";
inline const std::string kJoined = "joined";
inline const std::string kDead = "dead";
inline const std::string kLeaving = "leaving";        // "m" or "m.g" past a first life: leaving for good, finishing what is in flight
inline const std::string kFinished = "finished";
inline const std::string kLost = "lost";              // "m.g": incarnation g of m lost by a pipeline neighbour
inline const std::string kIncarnations = "incarnations";  // "m.g": m is in its g-th life
inline const std::string kRejoin = "rejoin";          // requests for a live replica's state
inline const std::string kDiverged = "diverged";      // "m.g@k": m sent a diverged message at outer step k
inline std::string started(int m) { return numbered("started", m); }
inline std::string summary(int m) { return numbered("summary", m); }
inline std::string refused(int m) { return numbered("refused", m); }
inline std::string exchange_reached(int m) { return numbered("reached", m); }  // the last exchange m went to
inline std::string snapshot(const std::string& name) { return in("snapshot", name); }
inline std::string donor(const std::string& request) { return in("donor", request); }
}  // namespace member

// What a group's members are listed under at a snapshot: an outer step's
// exchange, an evaluation's average.
inline std::string outer_step_snapshot(int64_t id) { return std::to_string(id); }
inline std::string evaluation_snapshot(int64_t step) { return numbered("evaluation", step); }

// An exchange's meeting, under meeting(group).
inline std::string meeting(const std::string& group) { return in(group, "meet"); }
inline std::string arrival(const std::string& key, int m) { return numbered(in(key, "here"), m); }
// What member m found on arriving ("came", or "alone": left behind first), for
// readers of a counter that says both came and left behind, in an order only m knows.
inline std::string arrival_verdict(const std::string& key, int m) { return numbered(in(key, "found"), m); }
inline std::string held_link(const std::string& key, int from, int to) {
  return numbered(numbered(in(key, "link"), from), to);
}
// An exchange is met under its id and its members; a second try of it under retry_of.
inline std::string exchange(int64_t id, const std::string& members) { return in(std::to_string(id), members); }
inline std::string retry_of(const std::string& key) { return in(key, "again"); }

// Links and their books.
inline std::string link_book(const std::string& book) { return in("links", book); }
inline std::string link_record(int rank, int incarnation) { return std::to_string(rank) + "." + std::to_string(incarnation); }
inline std::string latest_incarnation(int rank) { return numbered("latest", rank); }
inline std::string handover_book(const std::string& group) { return in(group, "handover"); }
inline std::string mesh_book(const std::string& group) { return in(group, "mesh"); }
inline std::string subgroup_book(const std::string& group) { return in(group, "groups"); }
inline const std::string kPipelineBook = "pipeline";
inline std::string formations(const std::string& group) { return in(group, "formations"); }
inline std::string formation_abandoned(const std::string& name, const std::string& members) {
  return in(in(name, members), "abandoned");
}
inline std::string run_mesh(int64_t n) { return numbered("mesh", n); }

// A pipeline's rosters: which stage replicas are live, one list per step.
inline const std::string kRosters = "pipeline/rosters";
inline std::string step_roster(int64_t step) { return numbered("step", step); }
inline std::string evaluation_roster(int64_t step) { return numbered("evaluation", step); }

// A replica's own process group, formed anew by each life of the replica.
inline std::string replica_workers(int replica, int life) {
  return numbered("replica" + std::to_string(replica) + "/workers", life);
}
// A Gloo group's tries, under process_group(name).
inline std::string process_group(const std::string& name) { return in(name, "pg"); }
inline std::string group_try(const std::string& name, int attempt) { return numbered(process_group(name), attempt); }
inline std::string verdicts(const std::string& tried) { return in(tried, "verdict"); }
namespace group {
inline const std::string kAbandoned = "abandoned";
inline const std::string kFailed = "failed";
inline std::string connected(int m) { return numbered("connected", m); }
inline std::string ok(int m) { return numbered("ok", m); }
}  // namespace group

// What a worker's live status says it is doing.
enum class WorkerState { starting, joining, training, finished, left };
inline const char* state_name(WorkerState s) {
  switch (s) {
    case WorkerState::starting: return "starting";
    case WorkerState::joining: return "joining";
    case WorkerState::training: return "training";
    case WorkerState::finished: return "finished";
    case WorkerState::left: return "left";
  }
  return "starting";
}
// A published state's end: "finished" or "left" (a page also shows "lost", which no worker says of itself).
inline bool ends_the_worker(const std::string& state) {
  return state == state_name(WorkerState::finished) || state == state_name(WorkerState::left);
}

// The live status.
inline const std::string kStatus = "status";
namespace status {
inline const std::string kMembers = "members";
inline const std::string kChanges = "changes";  // <rank>.<n> of the newest entry: a watcher's poll reads no further unless it moved
inline const std::string kWatchers = "watchers";
inline std::string last(int rank) { return in(std::to_string(rank), "last"); }
inline std::string entry(int rank, int64_t n) { return numbered(std::to_string(rank), n); }
inline std::string watcher(const std::string& id) { return in("watcher", id); }
}  // namespace status

}  // namespace noloco::record
