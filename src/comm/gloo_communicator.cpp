#include "comm/gloo_communicator.h"

#include <cstdlib>
#include <stdexcept>

#include <fmt/format.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

namespace noloco {

namespace {

using Clock = std::chrono::steady_clock;

double since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  if (!v || !*v) return fallback;
  char* end = nullptr;
  const long x = std::strtol(v, &end, 10);
  if (*end != '\0' || x < 0 || x > 1 << 30) throw std::invalid_argument(fmt::format("{}='{}' is not a valid number", name, v));
  return int(x);
}

}  // namespace

bool worker_env_from_environment(WorkerEnv& env) {
  if (!std::getenv("RANK")) return false;
  env.rank = env_int("RANK", 0);
  env.world = env_int("WORLD_SIZE", 1);
  env.local_rank = env_int("LOCAL_RANK", 0);
  if (const char* a = std::getenv("MASTER_ADDR")) env.master_addr = a;
  env.master_port = env_int("MASTER_PORT", 29500);
  const char* agent = std::getenv("TORCHELASTIC_USE_AGENT_STORE");
  env.agent_store = agent && std::string(agent) == "True";
  if (env.world < 1 || env.rank >= env.world)
    throw std::invalid_argument(fmt::format("RANK={} is outside WORLD_SIZE={}", env.rank, env.world));
  return true;
}

GlooCommunicator::GlooCommunicator(const WorkerEnv& env, const std::string& bind, std::chrono::milliseconds timeout)
    : rank_(env.rank), world_(env.world), timeout_(timeout) {
  c10d::TCPStoreOptions opts;
  opts.port = uint16_t(env.master_port);
  opts.isServer = env.rank == 0 && !env.agent_store;
  opts.numWorkers = c10::nullopt;
  opts.waitWorkers = false;
  opts.timeout = timeout;
  auto tcp = c10::make_intrusive<c10d::TCPStore>(env.master_addr, opts);
  store_ = c10::make_intrusive<c10d::PrefixStore>("noloco/pg", tcp);
  auto options = c10d::ProcessGroupGloo::Options::create(timeout);
  options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname(bind));
  options->threads = 2;
  pg_ = c10::make_intrusive<c10d::ProcessGroupGloo>(store_, rank_, world_, options);
}

GlooCommunicator::~GlooCommunicator() = default;

c10d::Store& GlooCommunicator::store() { return *store_; }

void GlooCommunicator::all_reduce_mean(torch::Tensor& t) {
  const auto start = Clock::now();
  auto cpu = t.device().is_cpu() ? t : t.to(torch::kCPU);
  std::vector<torch::Tensor> tensors{cpu};
  pg_->allreduce(tensors)->wait(timeout_);
  cpu.div_(world_);
  if (!t.device().is_cpu()) t.copy_(cpu);
  auto& s = charge();
  // A ring all-reduce sends and receives 2·(N−1)/N of the buffer per replica.
  const double share = 2.0 * double(world_ - 1) / double(world_);
  s.bytes_sent += uint64_t(share * double(cpu.nbytes()));
  s.bytes_received += uint64_t(share * double(cpu.nbytes()));
  s.collectives += 1;
  const double dt = since(start);
  s.comm_seconds += dt;
  s.wait_seconds += dt;  // a collective is one barrier: all of it is waiting on the slowest
}

torch::Tensor GlooCommunicator::group_mean(const torch::Tensor& payload, const std::vector<int>& group,
                                           std::vector<int>* arrived) {
  const auto start = Clock::now();
  auto& s = charge();
  auto local = payload.device().is_cpu() ? payload.contiguous() : payload.to(torch::kCPU);
  // The tag keeps consecutive exchanges with the same peer apart.
  const int tag = int(exchange_count_++ % (1 << 20));
  std::vector<std::pair<int, c10::intrusive_ptr<c10d::Work>>> sends, recvs;
  std::map<int, torch::Tensor> inbox;
  for (int peer : group) {
    if (peer == rank_) continue;
    try {
      std::vector<torch::Tensor> out{local};
      sends.emplace_back(peer, pg_->send(out, peer, tag));
      inbox[peer] = torch::empty_like(local);
      std::vector<torch::Tensor> in{inbox[peer]};
      recvs.emplace_back(peer, pg_->recv(in, peer, tag));
    } catch (const std::exception&) {
      inbox.erase(peer);  // the pair to this peer is already broken
    }
  }
  std::vector<int> counted{rank_};
  const auto wait_start = Clock::now();
  for (auto& [peer, work] : recvs) {
    try {
      work->wait(timeout_);
      counted.push_back(peer);
      s.bytes_received += local.nbytes();
    } catch (const std::exception&) {
      inbox.erase(peer);  // dead or silent peer: average without it
    }
  }
  s.wait_seconds += since(wait_start);
  for (auto& [peer, work] : sends) {
    try {
      work->wait(timeout_);
      s.bytes_sent += local.nbytes();
      s.messages += 1;
    } catch (const std::exception&) {
    }
  }
  std::sort(counted.begin(), counted.end());
  auto sum = torch::zeros(local.sizes(), torch::kFloat32);
  for (int r : counted) sum.add_(r == rank_ ? local : inbox.at(r));
  sum.div_(double(counted.size()));
  if (arrived) *arrived = counted;
  s.comm_seconds += since(start);
  return payload.device().is_cpu() ? sum : sum.to(payload.device());
}

}  // namespace noloco
