#include "comm/transport/nccl_collectives.h"

#include <stdexcept>

#include <fmt/format.h>

#ifdef NOLOCO_NCCL
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

namespace noloco {

#ifdef NOLOCO_NCCL

namespace {

using Clock = std::chrono::steady_clock;

class NcclCollectives final : public Collectives {
 public:
  NcclCollectives(c10::intrusive_ptr<c10d::ProcessGroupNCCL> pg, torch::Device device,
                  std::chrono::milliseconds timeout)
      : pg_(std::move(pg)), device_(device), timeout_(timeout) {}
  int rank() const override { return pg_->getRank(); }
  int world() const override { return pg_->getSize(); }

  void all_reduce_mean(torch::Tensor& t) override {
    const auto start = Clock::now();
    auto on_gpu = t.to(device_);  // t itself where it is on this worker's GPU (the gradients)
    std::vector<torch::Tensor> tensors{on_gpu};
    pg_->allreduce(tensors)->wait(timeout_);
    on_gpu.div_(world());
    if (on_gpu.data_ptr() != t.data_ptr()) t.copy_(on_gpu);
    // Counted as Gloo's ring is: 2·(N−1)/N of the buffer each way per member.
    const auto share = uint64_t(2.0 * double(world() - 1) / double(world()) * double(t.nbytes()));
    charge(cost(start, share, share));
  }

  void broadcast(torch::Tensor& t, int root) override {
    const auto start = Clock::now();
    auto on_gpu = t.to(device_);
    std::vector<torch::Tensor> tensors{on_gpu};
    c10d::BroadcastOptions options;
    options.rootRank = root;
    pg_->broadcast(tensors, options)->wait(timeout_);
    if (on_gpu.data_ptr() != t.data_ptr()) t.copy_(on_gpu);
    const bool sending = rank() == root;
    charge(cost(start, sending ? t.nbytes() * uint64_t(world() - 1) : 0, sending ? 0 : t.nbytes()));
  }

 private:
  // NCCL runs on its own stream: the time is the host's, up to the enqueue
  // where nothing on the host waits for the result.
  static CommStats cost(Clock::time_point start, uint64_t sent, uint64_t received) {
    CommStats s;
    s.bytes_sent = sent;
    s.bytes_received = received;
    s.collectives = 1;
    s.comm_seconds = s.wait_seconds = std::chrono::duration<double>(Clock::now() - start).count();
    return s;
  }

  c10::intrusive_ptr<c10d::ProcessGroupNCCL> pg_;
  torch::Device device_;
  std::chrono::milliseconds timeout_;
};

}  // namespace

bool nccl_built() { return true; }

std::unique_ptr<Collectives> join_nccl_group(const StorePtr& store, const std::string& name, int rank, int world,
                                           const std::string& device, std::chrono::milliseconds timeout) {
  const torch::Device gpu(device);
  if (!gpu.is_cuda()) throw std::invalid_argument(fmt::format("an NCCL group needs a CUDA device, not {}", device));
  auto options = c10d::ProcessGroupNCCL::Options::create();
  options->timeout = timeout;
  auto pg = c10::make_intrusive<c10d::ProcessGroupNCCL>(c10::make_intrusive<c10d::PrefixStore>(name, store), rank,
                                                        world, options);
  return std::make_unique<NcclCollectives>(std::move(pg), gpu, timeout);
}

#else

bool nccl_built() { return false; }

std::unique_ptr<Collectives> join_nccl_group(const StorePtr&, const std::string& name, int, int, const std::string&,
                                           std::chrono::milliseconds) {
  throw std::logic_error(fmt::format("group {}: this build has no NCCL (it needs a CUDA LibTorch)", name));
}

#endif

}  // namespace noloco
