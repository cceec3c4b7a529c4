// The CUDA path against the CPU path (the reference): the model, the fused
// optimizer and whole multi-worker runs sharing one GPU. Each test skips
// where LibTorch sees no GPU (Debian's LibTorch is CPU-only); scripts/gpu_check.sh
// runs them on a GPU machine (`--gtest_filter='Cuda*'`).
#include <gtest/gtest.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include "comm/transport/nccl_collectives.h"
#include "model/llama.h"
#include "optim/flat_params.h"
#include "optim/inner.h"
#include "test_util.h"
#include "util/torch_shim.h"

using namespace noloco;
using noloco::testing::read_text;
using noloco::testing::run_cli;
using noloco::testing::small_train_args;
using noloco::testing::train_losses;

namespace {

#define SKIP_WITHOUT_CUDA() \
  if (!torch::cuda::is_available()) GTEST_SKIP() << "LibTorch sees no CUDA device"

ModelConfig small_config() {
  ModelConfig c;
  c.vocab_size = 64;
  c.hidden = 64;
  c.layers = 2;
  c.heads = 4;
  c.intermediate = 160;
  c.context = 32;
  return c;
}

LlamaForCausalLM make_model(const torch::Device& device) {
  LlamaForCausalLM m(small_config());
  init_weights(m, 5);
  m->to(device);
  return m;
}

double relative_error(const torch::Tensor& got, const torch::Tensor& want) {
  auto w = want.detach().to(torch::kCPU, torch::kFloat64);
  return (got.detach().to(torch::kCPU, torch::kFloat64) - w).norm().item<double>() / w.norm().item<double>();
}

}  // namespace

// fp32 on the GPU is the CPU's function up to summation order; bf16 autocast
// (matmuls and attention in bf16, norms and the loss in fp32) stays within bf16's
// precision of it.
TEST(Cuda, ForwardAndGradientsMatchTheCpu) {
  SKIP_WITHOUT_CUDA();
  const torch::Device gpu(torch::kCUDA);
  auto cpu_model = make_model(torch::kCPU);
  auto gpu_model = make_model(gpu);
  auto gen = at::detail::createCPUGenerator(11);
  auto tokens = at::randint(64, {4, 32}, gen, torch::kInt64);
  auto targets = at::randint(64, {4, 32}, gen, torch::kInt64);

  auto cpu_loss = cpu_model->loss(tokens, targets);
  cpu_loss.backward();
  auto gpu_loss = gpu_model->loss(tokens.to(gpu), targets.to(gpu));
  gpu_loss.backward();
  EXPECT_LT(relative_error(gpu_loss, cpu_loss), 1e-5);
  const auto cpu_params = cpu_model->named_parameters();
  for (const auto& p : gpu_model->named_parameters())
    EXPECT_LT(relative_error(p.value().grad(), cpu_params[p.key()].grad()), 1e-4) << p.key();

  torch::Tensor bf16_loss;
  {
    shim::CudaBf16Autocast autocast(true);
    bf16_loss = gpu_model->loss(tokens.to(gpu), targets.to(gpu));
  }
  EXPECT_EQ(bf16_loss.scalar_type(), torch::kFloat32);
  EXPECT_LT(relative_error(bf16_loss, cpu_loss), 1e-2);
}

// The fused kernel (LibTorch 2.x) and the chunked CPU step are the same AdamW:
// six steps of the same gradients land within fp32 rounding of each other.
TEST(Cuda, FusedAdamWFollowsTheCpuStep) {
  SKIP_WITHOUT_CUDA();
  const torch::Device gpu(torch::kCUDA);
  auto cpu_model = make_model(torch::kCPU);
  auto gpu_model = make_model(gpu);
  FlatParams cpu_flat(*cpu_model), gpu_flat(*gpu_model);
  InnerConfig c;
  c.lr = 3e-3;
  c.weight_decay = 0.1;
  InnerOptimizer cpu_inner(cpu_flat, c), gpu_inner(gpu_flat, c);
  EXPECT_EQ(gpu_inner.fused(), TORCH_VERSION_MAJOR >= 2);
  auto gen = at::detail::createCPUGenerator(3);
  for (int step = 0; step < 6; ++step) {
    auto g = at::empty({cpu_flat.numel()}, torch::kFloat32);
    g.normal_(0.0, 1.0, gen);
    cpu_flat.grads().copy_(g);
    gpu_flat.grads().copy_(g);
    cpu_inner.set_lr(c.lr / (step + 1));
    gpu_inner.set_lr(c.lr / (step + 1));
    cpu_inner.step();
    gpu_inner.step();
  }
  EXPECT_LT(relative_error(gpu_flat.values(), cpu_flat.values()), 1e-6);
  TensorMap cpu_state, gpu_state;
  cpu_inner.save(cpu_state);
  gpu_inner.save(gpu_state);
  for (const auto& [name, t] : cpu_state) EXPECT_LT(relative_error(gpu_state.at(name), t), 1e-5) << name;
}

class CudaRuns : public noloco::testing::LaunchedRuns {
 protected:
  CudaRuns() { run_timeout_s = 240; }
  // The largest difference between two runs' training losses at the same
  // (replica, step), after checking both logged the same steps.
  static double largest_loss_difference(const std::string& a, const std::string& b, size_t records) {
    const auto la = train_losses(a), lb = train_losses(b);
    EXPECT_EQ(la.size(), records);
    EXPECT_EQ(lb.size(), records);
    double largest = 0;
    for (const auto& [key, loss] : la) largest = std::max(largest, std::abs(loss - lb.at(key)));
    return largest;
  }
  // The run `common` on cuda:0 and on the CPU, each logging `records` training
  // losses: their largest difference, printed for scripts/gpu_check.sh as `what`'s.
  double gpu_against_cpu(const std::string& what, const std::string& common, size_t records) {
    const auto gpu = run("gpu", common + " device=cuda:0");
    const auto cpu = run("cpu", common);
    const double largest = largest_loss_difference(gpu, cpu, records);
    std::printf("largest train-loss difference, %s GPU vs CPU: %.2e\n", what.c_str(), largest);
    return largest;
  }
};

// Four NoLoCo replicas as four processes on one GPU: the same run as on the
// CPU, with differences of summation order only (fp32).
TEST_F(CudaRuns, FourNoLoCoReplicasSharingOneGpuFollowTheCpuRun) {
  SKIP_WITHOUT_CUDA();
  EXPECT_LT(gpu_against_cpu("4 NoLoCo replicas", "method=noloco replicas=4 batch=4 steps=40 outer_interval=10", 4 * 40),
            2e-3);
}

// Two pipeline stages (activations and gradients cross between processes) on one GPU.
TEST_F(CudaRuns, TwoStagePipelineSharingOneGpuFollowsTheCpuRun) {
  SKIP_WITHOUT_CUDA();
  EXPECT_LT(gpu_against_cpu("2-stage pipeline", "stages=2 routing=fixed activation_codec=fp32 batch=4 grad_accum=2 steps=40", 40), 2e-3);
}

// A replica of two workers on one GPU (two NCCL members cannot share one, so
// its group is Gloo's, through the host): the gradients' all-reduce and the
// leader's weights broadcast move CUDA tensors, and the run is the CPU run's.
TEST_F(CudaRuns, ReplicaOfTwoWorkersSharingOneGpuFollowsTheCpuRun) {
  SKIP_WITHOUT_CUDA();
  EXPECT_LT(gpu_against_cpu("2 replicas x 2 workers",
                            "method=noloco replicas=2 replica_workers=2 batch=4 steps=40 outer_interval=10", 2 * 40),
            2e-3);
}

// The NCCL group itself, as far as one GPU can host it (one member): CPU
// tensors (the leader's flag, the logged loss) go through the GPU and come
// back, GPU tensors stay where they are, and nothing is counted as sent.
TEST(Cuda, NcclGroupOfOneKeepsTensorsWhereTheyAre) {
  SKIP_WITHOUT_CUDA();
  if (!nccl_built()) GTEST_SKIP() << "this build has no NCCL";
  auto group = join_nccl_group(c10::make_intrusive<c10d::HashStore>(), "one", 0, 1, "cuda:0",
                               std::chrono::seconds(60));
  auto grads = torch::arange(6, torch::dtype(torch::kFloat32).device(torch::kCUDA));
  const auto grads_before = grads.data_ptr();
  group->all_reduce_mean(grads);
  EXPECT_EQ(grads.data_ptr(), grads_before);
  EXPECT_TRUE(torch::equal(grads.cpu(), torch::arange(6, torch::kFloat32)));
  auto flag = torch::full({1}, 1.0f);
  group->broadcast(flag, 0);
  EXPECT_TRUE(flag.device().is_cpu());
  EXPECT_EQ(flag.item<float>(), 1.0f);
  EXPECT_EQ(group->stats().collectives, 2);
  EXPECT_EQ(group->stats().bytes_sent, 0u);
}

// device=cuda is the GPU of the worker's local rank: every worker of a run
// with as many replicas as GPUs trains on its own; one more is refused.
TEST_F(CudaRuns, EachLocalRankTrainsOnItsOwnGpuAndOneTooManyIsRefused) {
  SKIP_WITHOUT_CUDA();
  const int gpus = int(torch::cuda::device_count());
  const auto own = run("own", fmt::format("method=diloco replicas={} steps=10 outer_interval=5 device=cuda", gpus));
  for (int r = 0; r < gpus; ++r) {
    const auto summary = nlohmann::json::parse(read_text(own + fmt::format("/summary_r{}.json", r)));
    EXPECT_EQ(summary.at("device").get<std::string>(), fmt::format("cuda:{}", r));
  }
  const auto refused = run_cli(small_train_args(dir / "c.txt", dir / "refused") +
                                   fmt::format(" method=noloco replicas={} steps=10 device=cuda", gpus + 1),
                               run_timeout_s);
  EXPECT_NE(refused.exit_code, 0);
  EXPECT_NE(refused.output.find(fmt::format("local rank {} has none", gpus)), std::string::npos) << refused.output;
}

// Where LibTorch sees no GPU (Debian's), device=cuda is refused by the
// launcher in one line, before any worker starts.
TEST_F(CudaRuns, WithoutAGpuDeviceCudaIsRefusedBeforeAnyWorkerStarts) {
  if (torch::cuda::is_available()) GTEST_SKIP() << "this machine has a GPU";
  const auto r = run_cli(small_train_args(dir / "c.txt", dir / "cpu") + " method=noloco replicas=2 device=cuda", 60);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("device=cuda but no CUDA device is available to LibTorch"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("launching"), std::string::npos) << r.output;
}
