#include "config/worker_env.h"

#include <cstdlib>
#include <stdexcept>

#include <fmt/format.h>

#include "util/parse_number.h"

namespace noloco {

namespace {

int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  if (!v || !*v) return fallback;
  const int64_t x = parse_integer(name, v);
  if (x < 0 || x > (int64_t(1) << 30)) throw std::invalid_argument(fmt::format("{}='{}' is out of range", name, v));
  return int(x);
}

}  // namespace

bool worker_env_from_environment(WorkerEnv& env) {
  if (!std::getenv("RANK")) return false;
  env.rank = env_int("RANK", 0);
  env.world = env_int("WORLD_SIZE", 1);
  env.local_rank = env_int("LOCAL_RANK", 0);
  env.local_world = std::max(1, env_int("LOCAL_WORLD_SIZE", 1));
  if (const char* a = std::getenv("MASTER_ADDR")) env.master_addr = a;
  env.master_port = env_int("MASTER_PORT", 29500);
  const char* token = std::getenv("NOLOCO_RUN_TOKEN");
  if (!token || !*token)
    throw std::invalid_argument("NOLOCO_RUN_TOKEN is not set: give every worker of the run the same secret token");
  env.token = token;
  if (const char* store = std::getenv("NOLOCO_STORE")) env.store_url = store;
  if (!env.store_url.empty() && env.store_url.rfind("http://", 0) != 0 && env.store_url.rfind("https://", 0) != 0 &&
      env.store_url.rfind("unix://", 0) != 0)
    throw std::invalid_argument(fmt::format(
        "NOLOCO_STORE='{}' is not an etcd endpoint (http[s]://host:port or unix:///path)", env.store_url));
  env.restart = env_int("NOLOCO_RESTARTED", 0);
  const char* agent = std::getenv("TORCHELASTIC_USE_AGENT_STORE");
  env.agent_store = agent && std::string(agent) == "True";
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
