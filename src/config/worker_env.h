// Who this process is in a launched run: torchrun's environment variables.
#pragma once
#include <string>

namespace noloco {

struct WorkerEnv {
  int rank = 0, world = 1, local_rank = 0;
  int local_world = 1;  // workers sharing this machine's cores
  std::string master_addr = "127.0.0.1";
  int master_port = 0;
  bool agent_store = false;  // the store is hosted by the launcher (ours or torchrun's), not rank 0
  std::string token;         // NOLOCO_RUN_TOKEN: the run's shared secret
  // NOLOCO_STORE: an etcd endpoint (http[s]://host:port, or unix:///path as
  // our launcher sets) holding the run's store. Empty: under torchrun's agent
  // (or NOLOCO_STORE=tcp://host:port, which sets master_addr and
  // master_port), its c10d TCPStore at MASTER_ADDR:MASTER_PORT; without one,
  // an etcd that worker 0 hosts there.
  std::string store_url;
  // The public key an https:// store must present (curl's "sha256//BASE64");
  // set for the store worker 0 hosts, whose key derives from the token.
  std::string store_pin;
  // NOLOCO_RELAY: relays (host:port, comma-separated; `noloco serve` prints
  // it) that carry this worker's connections to peers it cannot reach
  // directly or that cannot reach it (comm/link/relay.h). Empty: direct only.
  std::string relays;
  // NOLOCO_RESTARTED: how many times our launcher started this worker before
  // (0: its first start). A replica of several workers is restarted whole,
  // and its own group formed anew under this number.
  int restart = 0;
};

// Whether noloco's launcher started this worker: it hosts the run's store as
// torchrun's agent does, and names it in NOLOCO_STORE.
inline bool launched_by_noloco(const WorkerEnv& env) { return env.agent_store && !env.store_url.empty(); }

// RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT
// (torchrun's names), NOLOCO_RUN_TOKEN, NOLOCO_STORE, NOLOCO_RELAY and NOLOCO_RESTARTED; returns false when RANK is unset
// (not a launched worker). Throws std::invalid_argument on malformed values.
bool worker_env_from_environment(WorkerEnv& env);
// NOLOCO_STORE and NOLOCO_RELAY alone, as `noloco serve` prints them (for
// `noloco join`, which takes the rest from the run). Throws
// std::invalid_argument on a malformed NOLOCO_STORE.
void run_endpoints_from_environment(WorkerEnv& env);
// The run's store at `store`, as NOLOCO_STORE names it (an etcd endpoint, or
// tcp://host:port for torchrun's agent's TCPStore); `named` (what the user
// set) heads a one-line std::invalid_argument for a malformed one.
void use_store(WorkerEnv& env, const std::string& store, const std::string& named);
// A joiner started outside the run's launcher: NOLOCO_STORE (the run's store;
// tcp://host:port for torchrun's agent's TCPStore), NOLOCO_RUN_TOKEN and
// WORLD_SIZE (the replicas the run started with; members are numbered on
// from there). Its rank is claimed from the store later. Returns false when
// NOLOCO_STORE is unset; throws std::invalid_argument naming a missing or
// malformed one, or a RANK set (a launched worker is not a joiner).
bool joiner_env_from_environment(WorkerEnv& env);

// The device a worker computes on: `device=cuda` is the GPU of the worker's
// local rank (one GPU per local rank, as torchrun's users expect); cpu and an
// explicit cuda:N stay as given. Throws std::invalid_argument, in one line,
// when the local rank has no GPU of its own (`cuda_devices` is how many
// LibTorch sees).
std::string worker_device(const std::string& configured, int local_rank, int cuda_devices);

}  // namespace noloco
