#include "comm/gloo_communicator.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <random>
#include <stdexcept>

#include <fmt/format.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

namespace noloco {

namespace {

using Clock = std::chrono::steady_clock;

double since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// The store namespace for deaths and member snapshots of one group of the run with `token`.
c10::intrusive_ptr<c10d::Store> membership_store(const c10::intrusive_ptr<c10d::Store>& store, const std::string& token,
                                                 const std::string& group) {
  return c10::make_intrusive<c10d::PrefixStore>("noloco/" + token + "/" + group + "/members", store);
}

std::string read_or_empty(c10d::Store& store, const std::string& key) {
  if (!store.check({key})) return "";
  const auto bytes = store.get(key);
  return {bytes.begin(), bytes.end()};
}

std::vector<uint8_t> bytes_of(const std::string& s) { return {s.begin(), s.end()}; }

// Appends `rank` to the comma-separated "dead" list, atomically: one key, so
// a members snapshot costs one read however many replicas there are.
void add_dead(c10d::Store& members, int rank) {
  std::string current = read_or_empty(members, "dead");
  const std::string mine = fmt::format("{},", rank);
  while (("," + current).find("," + mine) == std::string::npos) {
    const auto wanted = current + mine;
    const auto result = members.compareSet("dead", bytes_of(current), bytes_of(wanted));
    current.assign(result.begin(), result.end());
  }
}

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
  const char* token = std::getenv("NOLOCO_RUN_TOKEN");
  if (!token || !*token)
    throw std::invalid_argument("NOLOCO_RUN_TOKEN is not set: give every worker of the run the same secret token");
  env.token = token;
  const char* agent = std::getenv("TORCHELASTIC_USE_AGENT_STORE");
  env.agent_store = agent && std::string(agent) == "True";
  if (env.world < 1 || env.rank >= env.world)
    throw std::invalid_argument(fmt::format("RANK={} is outside WORLD_SIZE={}", env.rank, env.world));
  return true;
}

c10::intrusive_ptr<c10d::Store> connect_store(const WorkerEnv& env, std::chrono::milliseconds timeout) {
  c10d::TCPStoreOptions opts;
  opts.port = uint16_t(env.master_port);
  opts.isServer = env.rank == 0 && !env.agent_store;
  opts.numWorkers = c10::nullopt;
  opts.waitWorkers = false;
  opts.timeout = timeout;
  return c10::make_intrusive<c10d::TCPStore>(env.master_addr, opts);
}

c10::intrusive_ptr<c10d::ProcessGroupGloo> join_process_group(const c10::intrusive_ptr<c10d::Store>& store,
                                                              const WorkerEnv& env, const std::string& group,
                                                              int rank, int world, const std::string& bind,
                                                              std::chrono::milliseconds timeout) {
  // The store cannot list keys, so keys under a secret prefix can be neither
  // found nor forged by a process without the token: it cannot join the run.
  auto prefixed = c10::make_intrusive<c10d::PrefixStore>("noloco/" + env.token + "/" + group + "/pg", store);
  auto options = c10d::ProcessGroupGloo::Options::create(timeout);
  options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname(bind));
  options->threads = 2;
  try {
    return c10::make_intrusive<c10d::ProcessGroupGloo>(prefixed, rank, world, options);
  } catch (const std::exception& e) {
    throw std::runtime_error(fmt::format(
        "could not join the run at {}:{} as worker {} ({} {} of {}) within {}s (wrong NOLOCO_RUN_TOKEN, or the other "
        "workers are gone): {}",
        env.master_addr, env.master_port, env.rank, group, rank, world, timeout.count() / 1000,
        std::string(e.what()).substr(0, std::string(e.what()).find('\n'))));
  }
}

GlooCommunicator::GlooCommunicator(const c10::intrusive_ptr<c10d::Store>& store, const WorkerEnv& env,
                                   const std::string& group, int rank, int world, const std::string& bind,
                                   std::chrono::milliseconds timeout)
    : rank_(rank), world_(world), timeout_(timeout) {
  membership_ = membership_store(store, env.token, group);
  run_id_ = run_id_of(env.token);
  pg_ = join_process_group(store, env, group, rank, world, bind, timeout);
}

std::string check_message_header(const MessageHeader& expected, const MessageHeader& got) {
  if (got.magic != expected.magic) return "not a noloco message";
  if (got.run != expected.run) return "message from another run (token mismatch)";
  if (got.exchange != expected.exchange)
    return fmt::format("message for exchange {}, expected {}", got.exchange, expected.exchange);
  if (got.numel != expected.numel) return fmt::format("message of {} elements, expected {}", got.numel, expected.numel);
  if (got.dtype != expected.dtype) return fmt::format("message of dtype {}, expected {}", got.dtype, expected.dtype);
  return "";
}

void declare_dead(const c10::intrusive_ptr<c10d::Store>& store, const std::string& token, const std::string& group,
                  int rank) {
  add_dead(*membership_store(store, token, group), rank);
}

std::vector<int> GlooCommunicator::members(int64_t outer_step) {
  // The first replica to reach this outer step writes the snapshot; everyone
  // else reads that one, so all agree even though deaths are noticed at
  // different moments. A death noticed too late for a snapshot costs only
  // its partner a lone outer step.
  const auto key = fmt::format("snapshot/{}", outer_step);
  std::string text = read_or_empty(*membership_, key);
  if (text.empty()) {
    const std::string dead = "," + read_or_empty(*membership_, "dead");
    std::string alive;
    for (int r = 0; r < world_; ++r)
      if (dead.find(fmt::format(",{},", r)) == std::string::npos) alive += fmt::format("{},", r);
    const auto agreed = membership_->compareSet(key, {}, bytes_of(alive));
    text.assign(agreed.begin(), agreed.end());
  }
  std::vector<int> out;
  for (size_t pos = 0; pos < text.size();) {
    const size_t comma = text.find(',', pos);
    out.push_back(std::stoi(text.substr(pos, comma - pos)));
    pos = comma + 1;
  }
  if (std::find(out.begin(), out.end(), rank_) == out.end()) out.push_back(rank_);  // declared dead, yet here
  std::sort(out.begin(), out.end());
  return out;
}

int64_t run_id_of(const std::string& token) {
  return int64_t(std::hash<std::string>{}(token) & 0x7fffffffffffffffull);
}

std::string new_run_token() {
  std::random_device rd;
  return fmt::format("{:08x}{:08x}{:08x}{:08x}", rd(), rd(), rd(), rd());
}

GlooCommunicator::~GlooCommunicator() = default;

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
  // Tags keep consecutive exchanges with the same peer apart: 2k for the header, 2k+1 for the payload.
  const int64_t exchange = exchange_count_++;
  const int tag = int((exchange % (1 << 20)) * 2);
  const MessageHeader mine{0x6e6f6c6f636fLL, run_id_, exchange, local.numel(), int64_t(local.scalar_type())};
  const auto my_header = torch::tensor({mine.magic, mine.run, mine.exchange, mine.numel, mine.dtype}, torch::kInt64);
  std::vector<std::pair<int, c10::intrusive_ptr<c10d::Work>>> sends, header_recvs;
  std::map<int, torch::Tensor> headers, inbox;
  for (int peer : group) {
    if (peer == rank_) continue;
    try {
      std::vector<torch::Tensor> h{my_header}, out{local};
      sends.emplace_back(peer, pg_->send(h, peer, tag));
      sends.emplace_back(peer, pg_->send(out, peer, tag + 1));
      headers[peer] = torch::empty({5}, torch::kInt64);
      std::vector<torch::Tensor> in{headers[peer]};
      header_recvs.emplace_back(peer, pg_->recv(in, peer, tag));
    } catch (const std::exception&) {
      headers.erase(peer);  // the pair to this peer is already broken
    }
  }
  std::vector<int> counted{rank_};
  const auto wait_start = Clock::now();
  for (auto& [peer, work] : header_recvs) {
    try {
      work->wait(timeout_);
      const auto* h = headers[peer].data_ptr<int64_t>();
      const auto problem = check_message_header(mine, MessageHeader{h[0], h[1], h[2], h[3], h[4]});
      if (!problem.empty()) {
        std::fprintf(stderr, "noloco[worker %d]: rejected a message from worker %d: %s\n", rank_, peer, problem.c_str());
        continue;
      }
      inbox[peer] = torch::empty_like(local);
      std::vector<torch::Tensor> in{inbox[peer]};
      pg_->recv(in, peer, tag + 1)->wait(timeout_);
      counted.push_back(peer);
      s.bytes_received += local.nbytes();
    } catch (const std::exception&) {
      inbox.erase(peer);  // dead or silent peer: average without it, and tell the others
      try {
        add_dead(*membership_, peer);
      } catch (const std::exception&) {
      }
    }
  }
  s.wait_seconds += since(wait_start);
  for (size_t i = 0; i < sends.size(); ++i) {
    try {
      sends[i].second->wait(timeout_);
      if (i % 2 == 1) {  // the payload; headers (40 bytes) are not counted as training traffic
        s.bytes_sent += local.nbytes();
        s.messages += 1;
      }
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
