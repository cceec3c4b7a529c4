#include "config/worker_env.h"

#include <cstdlib>
#include <stdexcept>

#include <fmt/format.h>

#include "util/parse_number.h"
#include "util/run_token.h"

namespace noloco {

namespace {

int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  if (!v || !*v) return fallback;
  const int64_t x = parse_integer(name, v);
  if (x < 0 || x > (int64_t(1) << 30)) throw std::invalid_argument(fmt::format("{}='{}' is out of range", name, v));
  return int(x);
}

std::string run_token_from_environment() {
  const auto token = run_token_in_environment();
  if (!token) throw std::invalid_argument("NOLOCO_RUN_TOKEN is not set: give every worker of the run the same secret token");
  return *token;
}

void store_from_environment(WorkerEnv& env) {
  const char* given = std::getenv("NOLOCO_STORE");
  use_store(env, given ? given : "", "NOLOCO_STORE");
}

void relays_from_environment(WorkerEnv& env) {
  if (const char* relays = std::getenv("NOLOCO_RELAY")) env.relays = relays;
}

}  // namespace

void use_store(WorkerEnv& env, const std::string& store, const std::string& named) {
  if (store.rfind("tcp://", 0) == 0) {
    const auto address = parse_host_port(named, store.substr(6));
    if (!address.port) throw std::invalid_argument(fmt::format("{}='{}' is not tcp://host:port", named, store));
    env.master_addr = address.host;
    env.master_port = *address.port;
    env.agent_store = true;
    return;
  }
  if (!store.empty() && store.rfind("http://", 0) != 0 && store.rfind("https://", 0) != 0 &&
      store.rfind("unix://", 0) != 0)
    throw std::invalid_argument(fmt::format(
        "{}='{}' is not an etcd endpoint (http[s]://host:port or unix:///path) or tcp://host:port", named, store));
  env.store_url = store;
}

void run_endpoints_from_environment(WorkerEnv& env) {
  store_from_environment(env);
  relays_from_environment(env);
}

bool joiner_env_from_environment(WorkerEnv& env) {
  const char* store = std::getenv("NOLOCO_STORE");
  if (!store || !*store) return false;
  if (std::getenv("RANK"))
    throw std::invalid_argument(
        "RANK is set: a joiner takes the next replica id from the run's store; start it outside the run's launcher");
  env.world = env_int("WORLD_SIZE", 0);
  if (env.world < 1)
    throw std::invalid_argument("WORLD_SIZE is not set: give a joiner the number of replicas the run started with");
  env.local_rank = env_int("LOCAL_RANK", 0);
  env.local_world = std::max(1, env_int("LOCAL_WORLD_SIZE", 1));
  env.token = run_token_from_environment();
  store_from_environment(env);
  relays_from_environment(env);
  env.agent_store = true;  // hosted by the run, never by the joiner
  return true;
}

bool worker_env_from_environment(WorkerEnv& env) {
  if (!std::getenv("RANK")) return false;
  env.rank = env_int("RANK", 0);
  env.world = env_int("WORLD_SIZE", 1);
  env.local_rank = env_int("LOCAL_RANK", 0);
  env.local_world = std::max(1, env_int("LOCAL_WORLD_SIZE", 1));
  if (const char* a = std::getenv("MASTER_ADDR")) env.master_addr = a;
  env.master_port = env_int("MASTER_PORT", 29500);
  env.token = run_token_from_environment();
  const char* agent = std::getenv("TORCHELASTIC_USE_AGENT_STORE");
  env.agent_store = agent && std::string(agent) == "True";
  store_from_environment(env);
  relays_from_environment(env);
  env.restart = env_int("NOLOCO_RESTARTED", 0);
  if (env.world < 1 || env.rank >= env.world)
    throw std::invalid_argument(fmt::format("RANK={} is outside WORLD_SIZE={}", env.rank, env.world));
  return true;
}

std::string worker_device(const std::string& configured, int local_rank, int cuda_devices) {
  if (configured != "cuda") return configured;
  if (cuda_devices == 0) throw std::invalid_argument("device=cuda but no CUDA device is available to LibTorch");
  if (local_rank >= cuda_devices)
    throw std::invalid_argument(fmt::format(
        "device=cuda gives each local rank its own GPU, but local rank {} has none ({} CUDA device{} here): start at "
        "most {} worker{} on this machine, or name one GPU for all with device=cuda:N",
        local_rank, cuda_devices, cuda_devices == 1 ? "" : "s", cuda_devices, cuda_devices == 1 ? "" : "s"));
  return fmt::format("cuda:{}", local_rank);
}

}  // namespace noloco
