// Communicator over c10d's ProcessGroupGloo (TCP), rendezvous through a TCPStore.
#pragma once
#include <chrono>
#include <map>
#include <set>
#include <thread>
#include <memory>
#include <string>

#include "comm/communicator.h"

namespace c10d {
class Store;
class ProcessGroupGloo;
}  // namespace c10d

namespace noloco {

struct WorkerEnv {
  int rank = 0, world = 1, local_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 0;
  bool agent_store = false;  // the store is hosted by the launcher (ours or torchrun's), not rank 0
  std::string token;         // NOLOCO_RUN_TOKEN: the run's shared secret
};

// What precedes every point-to-point payload, so that a message from another
// run, another exchange, or of another size or dtype is never averaged in.
struct MessageHeader {
  int64_t magic = 0, run = 0, exchange = 0, numel = 0, dtype = 0;
};
// Empty if `got` is acceptable where `expected` was wanted, else the reason.
std::string check_message_header(const MessageHeader& expected, const MessageHeader& got);
// The token's hash, carried in message headers (the token itself never travels).
int64_t run_id_of(const std::string& token);
// A fresh random token (hex) for a launched run.
std::string new_run_token();
// Records that member `rank` of group `group` is gone, in the run's membership namespace of `store`.
void declare_dead(const c10::intrusive_ptr<c10d::Store>& store, const std::string& token, const std::string& group,
                  int rank);

// The run's store: hosted by the launcher (ours or torchrun's), else by worker 0.
c10::intrusive_ptr<c10d::Store> connect_store(const WorkerEnv& env, std::chrono::milliseconds timeout);

// A Gloo process group of `world` members under the run's secret prefix;
// `group` names it, so one run can hold several (replicas of a stage, the pipeline).
c10::intrusive_ptr<c10d::ProcessGroupGloo> join_process_group(const c10::intrusive_ptr<c10d::Store>& store,
                                                              const WorkerEnv& env, const std::string& group,
                                                              int rank, int world, const std::string& bind,
                                                              std::chrono::milliseconds timeout);

// RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT (torchrun's names);
// returns false when RANK is unset (not a launched worker). Throws on malformed values.
bool worker_env_from_environment(WorkerEnv& env);

// The run-wide process group serves the collectives (DDP, DiLoCo, evaluation).
// NoLoCo's exchanges each form a small process group of just the group's
// members, under a store prefix named by the exchange and the members'
// incarnations: Gloo cannot re-add a restarted rank to an existing group, but
// a restarted worker can take part in any later exchange.
class GlooCommunicator final : public Communicator {
 public:
  // Member `rank` of `world` in group `group` of the run; Gloo listens on `bind`.
  // A partner whose heartbeat (comm/heartbeat.h) stops for `heartbeat_timeout` is given up.
  GlooCommunicator(const c10::intrusive_ptr<c10d::Store>& store, const WorkerEnv& env, const std::string& group,
                   int rank, int world, const std::string& bind, std::chrono::milliseconds timeout,
                   std::chrono::milliseconds heartbeat_timeout);
  ~GlooCommunicator() override;
  int rank() const override { return rank_; }
  int world() const override { return world_; }
  void all_reduce_mean(torch::Tensor& t) override;
  torch::Tensor group_mean(const torch::Tensor& payload, const std::vector<int>& group, int64_t exchange,
                           std::vector<int>* arrived) override;
  std::vector<int> members(int64_t outer_step) override;
  int incarnation() const override { return incarnation_; }
  PeerState receive_state(int64_t numel) override;
  std::vector<int> serve_rejoins(int64_t step, int64_t adam_steps, const std::function<torch::Tensor()>& pack) override;
  void finish() override;
  std::unique_ptr<Communicator> live_group(int64_t step) override;

 private:
  // The members listed under snapshot `key`, written by the first replica to ask.
  std::vector<int> agreed_members(const std::string& key);
  // Peers of `group` that announced themselves for exchange `key` within the
  // timeout and are not declared dead; the others are declared dead.
  std::vector<int> present_peers(const std::string& key, const std::vector<int>& group, std::vector<int>* late);
  c10::intrusive_ptr<c10d::ProcessGroupGloo> join(const std::string& name, int rank, int world,
                                                  std::chrono::milliseconds timeout);
  // Destroys an exchange's group on a background thread.
  void release(c10::intrusive_ptr<c10d::ProcessGroupGloo> pg);

  int rank_, world_;
  int incarnation_ = 0;
  std::chrono::milliseconds timeout_, heartbeat_timeout_;
  c10::intrusive_ptr<c10d::Store> store_;       // the run's store, unprefixed
  c10::intrusive_ptr<c10d::Store> membership_;  // deaths, incarnations, snapshots, rejoin requests
  c10::intrusive_ptr<c10d::Store> watch_raw_;   // a second connection, for present_peers' watchdog
  c10::intrusive_ptr<c10d::Store> watch_;       // membership_'s keys on it
  WorkerEnv env_;
  std::string group_, bind_;
  c10::intrusive_ptr<c10d::ProcessGroupGloo> pg_;  // run-wide; absent in a restarted worker
  std::map<int, int> incarnation_of_;             // from the latest members snapshot
  std::set<std::string> seen_requests_;
  std::thread releasing_;
  int64_t run_id_ = 0;  // hash of the token, carried in message headers
};

}  // namespace noloco
