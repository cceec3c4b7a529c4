#include "comm/transport/gloo_transport.h"

#include <fmt/format.h>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "comm/transport/seal.h"

namespace noloco {

std::vector<uint8_t> CollectiveSeal::context(int64_t kind, int64_t number, int from, int to) const {
  auto bytes = seal_context({run, kind, number, from, to});
  bytes.insert(bytes.end(), group.begin(), group.end());
  return bytes;
}

namespace {

using Clock = std::chrono::steady_clock;

double since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

uint8_t* bytes_ptr(const torch::Tensor& t) { return static_cast<uint8_t*>(t.data_ptr()); }

enum CollectiveKind : int64_t { kGather = 1, kToAll = 2, kBroadcast = 3 };

torch::Tensor sealed_copy(const CollectiveSeal& sealing, const torch::Tensor& plain, const std::vector<uint8_t>& context) {
  auto sealed = torch::empty({int64_t(plain.nbytes() + Seal::kOverhead)}, torch::kUInt8);
  sealing.seal->seal(bytes_ptr(plain), plain.nbytes(), context, bytes_ptr(sealed));
  return sealed;
}

torch::Tensor opened(const CollectiveSeal& sealing, const torch::Tensor& sealed, const std::vector<uint8_t>& context,
                     int from, int64_t number) {
  auto plain = torch::empty({int64_t(sealed.nbytes() - Seal::kOverhead)}, torch::kUInt8);
  if (!sealing.seal->open(bytes_ptr(sealed), plain.nbytes(), context, bytes_ptr(plain)))
    throw std::runtime_error(fmt::format("the message of group member {} in collective {} of {} failed "
                                         "authentication (changed on the way, replayed, or sealed with another "
                                         "token): not used",
                                         from, number, sealing.group));
  return plain;
}

CommStats plain_all_reduce_mean_over(c10d::ProcessGroupGloo& pg, torch::Tensor& t, int world,
                                     std::chrono::milliseconds timeout) {
  CommStats s;
  const auto start = Clock::now();
  auto cpu = t.device().is_cpu() ? t : t.to(torch::kCPU);
  std::vector<torch::Tensor> tensors{cpu};
  pg.allreduce(tensors)->wait(timeout);
  cpu.div_(world);
  if (!t.device().is_cpu()) t.copy_(cpu);
  // A ring all-reduce sends and receives 2·(N−1)/N of the buffer per member.
  const double share = 2.0 * double(world - 1) / double(world);
  s.bytes_sent += uint64_t(share * double(cpu.nbytes()));
  s.bytes_received += uint64_t(share * double(cpu.nbytes()));
  s.collectives += 1;
  const double dt = since(start);
  s.comm_seconds += dt;
  s.wait_seconds += dt;  // a collective is one barrier: all of it is waiting on the slowest
  return s;
}

std::vector<torch::Tensor> all_gather_over(c10d::ProcessGroupGloo& pg, const torch::Tensor& bytes, int world,
                                           std::chrono::milliseconds timeout, CommStats& s, CollectiveSeal& sealing) {
  s = CommStats{};
  const auto start = Clock::now();
  const int64_t number = sealing.count++;
  std::vector<torch::Tensor> input{bytes.contiguous()};
  if (sealing.seal) input[0] = sealed_copy(sealing, input[0], sealing.context(kGather, number, pg.getRank(), -1));
  std::vector<std::vector<torch::Tensor>> output(1);
  for (int r = 0; r < world; ++r) output[0].push_back(torch::empty_like(input[0]));
  pg.allgather(output, input)->wait(timeout);
  // Each member's payload reaches the N−1 others once.
  s.bytes_sent += uint64_t(world - 1) * uint64_t(input[0].nbytes());
  s.bytes_received += uint64_t(world - 1) * uint64_t(input[0].nbytes());
  if (sealing.seal)
    for (int r = 0; r < world; ++r)
      output[0][size_t(r)] = opened(sealing, output[0][size_t(r)], sealing.context(kGather, number, r, -1), r, number);
  s.collectives += 1;
  const double dt = since(start);
  s.comm_seconds += dt;
  s.wait_seconds += dt;
  return output[0];
}

std::vector<torch::Tensor> all_to_all_over(c10d::ProcessGroupGloo& pg, const torch::Tensor& bytes, int world,
                                           std::chrono::milliseconds timeout, CommStats& s, CollectiveSeal& sealing) {
  TORCH_CHECK(bytes.numel() % world == 0, "all_to_all needs equal chunks");
  s = CommStats{};
  const auto start = Clock::now();
  const int64_t number = sealing.count++;
  const int self = pg.getRank();
  auto input = bytes.contiguous();
  if (sealing.seal) {
    std::vector<torch::Tensor> sealed;
    const auto chunks = input.chunk(world);
    for (int to = 0; to < world; ++to)
      sealed.push_back(sealed_copy(sealing, chunks[size_t(to)], sealing.context(kToAll, number, self, to)));
    input = torch::cat(sealed);
  }
  auto output = torch::empty_like(input);
  std::vector<int64_t> equal;
  pg.alltoall_base(output, input, equal, equal)->wait(timeout);
  const uint64_t chunk = uint64_t(input.numel() / world);
  s.bytes_sent += uint64_t(world - 1) * chunk;
  s.bytes_received += uint64_t(world - 1) * chunk;
  auto incoming = output.chunk(world);
  if (sealing.seal)
    for (int from = 0; from < world; ++from)
      incoming[size_t(from)] =
          opened(sealing, incoming[size_t(from)], sealing.context(kToAll, number, from, self), from, number);
  s.collectives += 1;
  const double dt = since(start);
  s.comm_seconds += dt;
  s.wait_seconds += dt;
  return incoming;
}

CommStats broadcast_over(c10d::ProcessGroupGloo& pg, torch::Tensor& t, int root, int world,
                         std::chrono::milliseconds timeout, CollectiveSeal& sealing) {
  CommStats s;
  const auto start = Clock::now();
  const int64_t number = sealing.count++;
  const bool sending = pg.getRank() == root;
  auto plain = t.detach().to(torch::kCPU).contiguous();  // t itself where it is a contiguous CPU tensor
  auto bytes = plain.view(-1).view(torch::kUInt8);
  const auto context = sealing.context(kBroadcast, number, root, -1);
  auto wire = bytes;
  if (sealing.seal)
    wire = sending ? sealed_copy(sealing, bytes, context)
                   : torch::empty({bytes.numel() + int64_t(Seal::kOverhead)}, torch::kUInt8);
  std::vector<torch::Tensor> tensors{wire};
  c10d::BroadcastOptions options;
  options.rootRank = root;
  pg.broadcast(tensors, options)->wait(timeout);
  if (!sending) {
    if (sealing.seal) bytes.copy_(opened(sealing, wire, context, root, number));
    if (plain.data_ptr() != t.data_ptr()) t.copy_(plain);
  }
  // Counted as a tree would send it: the root's payload reaches the N−1 others once.
  (sending ? s.bytes_sent : s.bytes_received) += uint64_t(wire.nbytes()) * uint64_t(sending ? world - 1 : 1);
  s.collectives += 1;
  s.comm_seconds = s.wait_seconds = since(start);
  return s;
}

// Sealed, the mean cannot run inside Gloo's all-reduce (it adds the bytes it
// carries): it runs as a reduce-scatter through the sealed all-to-all, each
// member adding up its slice in rank order, and an all-gather of the slices.
// The same bytes on the wire per member as Gloo's ring, 2·(N−1)/N of the
// buffer, and the same result on every member.
CommStats all_reduce_mean_over(c10d::ProcessGroupGloo& pg, torch::Tensor& t, int world,
                               std::chrono::milliseconds timeout, CollectiveSeal& sealing) {
  if (!sealing.seal) return plain_all_reduce_mean_over(pg, t, world, timeout);
  const auto start = Clock::now();
  const auto flat = t.detach().to(torch::kCPU).contiguous().view(-1);
  const int64_t n = flat.numel(), slice = (n + world - 1) / world;
  auto padded = torch::zeros({slice * world}, flat.options());
  padded.narrow(0, 0, n).copy_(flat);
  CommStats scatter, gather;
  const auto parts = all_to_all_over(pg, padded.view(torch::kUInt8), world, timeout, scatter, sealing);
  auto own = torch::zeros({slice}, flat.options());
  for (const auto& part : parts) own.add_(part.view(flat.scalar_type()));
  own.div_(world);
  const auto slices = all_gather_over(pg, own.view(torch::kUInt8), world, timeout, gather, sealing);
  std::vector<torch::Tensor> values;
  for (const auto& b : slices) values.push_back(b.view(flat.scalar_type()));
  t.copy_(torch::cat(values).narrow(0, 0, n).view_as(t));
  CommStats s = scatter;
  s += gather;
  s.collectives = 1;
  s.comm_seconds = s.wait_seconds = since(start);
  return s;
}

}  // namespace

GlooTransport::GlooTransport(std::function<StorePtr()> connect, const WorkerEnv& env, std::string scope, int self,
                             int world, const std::string& bind, std::chrono::milliseconds timeout,
                             std::shared_ptr<const Seal> seal)
    : connect_(std::move(connect)),
      env_(env),
      scope_(std::move(scope)),
      self_(self),
      world_(world),
      bind_(bind),
      timeout_(timeout),
      seal_(std::move(seal)),
      sealing_{seal_.get(), scope_, run_id_of(env.token)} {}

GlooTransport::~GlooTransport() = default;

c10d::ProcessGroupGloo& GlooTransport::group() {
  if (!group_) group_ = join_gloo_group(connect_(), env_, scope_, self_, world_, bind_, timeout_, seal_.get());
  return *group_;
}

void GlooTransport::all_reduce_mean(torch::Tensor& t) { charge(all_reduce_mean_over(group(), t, world_, timeout_, sealing_)); }

void GlooTransport::broadcast(torch::Tensor& t, int root) {
  charge(broadcast_over(group(), t, root, world_, timeout_, sealing_));
}

}  // namespace noloco
