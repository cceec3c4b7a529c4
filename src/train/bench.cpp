#include "train/bench.h"

#include <chrono>

#include "model/llama.h"
#include "optim/flat_params.h"
#include "optim/inner.h"
#include "util/compute_threads.h"
#include "util/process_runtime.h"
#include "util/process_stats.h"
#include "util/progress.h"
#include "util/torch_shim.h"

namespace noloco {

namespace {

using Clock = std::chrono::steady_clock;

void synchronize(const torch::Device& d) {
  if (d.is_cuda()) torch::cuda::synchronize(d.index() < 0 ? 0 : d.index());
}

// The best dense matmul rate this device reaches in the run's precision: the
// honest denominator for utilisation when no datasheet number is given.
double measured_peak_tflops(const torch::Device& device, torch::ScalarType dtype) {
  const int64_t n = device.is_cuda() ? 8192 : 1024;
  // One big matmul may use every core through OpenBLAS's own pool.
  set_blas_threads(torch::get_num_threads());
  auto a = torch::randn({n, n}, torch::TensorOptions().device(device).dtype(dtype));
  auto b = torch::randn({n, n}, torch::TensorOptions().device(device).dtype(dtype));
  torch::matmul(a, b);
  synchronize(device);
  double best = 0;
  for (int rep = 0; rep < 5; ++rep) {
    const auto t0 = Clock::now();
    torch::matmul(a, b);
    synchronize(device);
    const double s = std::chrono::duration<double>(Clock::now() - t0).count();
    best = std::max(best, 2.0 * double(n) * double(n) * double(n) / s / 1e12);
  }
  set_blas_threads(1);
  return best;
}

}  // namespace

nlohmann::json bench_training(const TrainConfig& c, int64_t steps, double peak_tflops) {
  set_compute_threads(int(c.run.threads));
  torch::Device device(c.run.device);
  if (device.is_cuda() && !torch::cuda::is_available())
    throw std::runtime_error("device=cuda but no CUDA device is available to LibTorch");
  ModelConfig arch = c.model;
  arch.vocab_size = c.data.vocab_size > 0 ? c.data.vocab_size : 256;
  LlamaForCausalLM model(arch);
  model->to(device);
  FlatParams flat(*model);
  InnerOptimizer inner(flat, c.inner);
  auto x = torch::randint(arch.vocab_size, {c.inner.batch, arch.context}, torch::TensorOptions().dtype(torch::kInt64).device(device));
  auto y = torch::randint(arch.vocab_size, {c.inner.batch, arch.context}, torch::TensorOptions().dtype(torch::kInt64).device(device));
  auto one_step = [&] {
    flat.grads().zero_();
    torch::Tensor loss;
    {
      shim::CudaBf16Autocast autocast(c.run.precision == Precision::bf16);
      loss = model->loss(x, y);
    }
    loss.backward();
    inner.clip_gradients(c.inner.clip);
    inner.step();
  };
  one_step();
  one_step();
  synchronize(device);
  Progress progress("bench", steps);
  const auto t0 = Clock::now();
  for (int64_t i = 0; i < steps; ++i) {
    one_step();
    if (device.is_cpu()) progress.update(i + 1);  // on a GPU, printing would force a sync per step
  }
  synchronize(device);
  const double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  const double tokens = double(steps * c.inner.batch * arch.context);
  const double tps = tokens / seconds;
  const double achieved = tps * arch.train_flops_per_token() / 1e12;
  const bool measured = peak_tflops <= 0;
  const double peak = measured ? measured_peak_tflops(device, c.run.precision == Precision::bf16 ? torch::kBFloat16 : torch::kFloat32) : peak_tflops;
  return {{"model", c.preset},
          {"precision", choice_name(c.run.precision)},
          {"device", device.str()},
          {"params", arch.num_params()},
          {"batch", c.inner.batch},
          {"context", arch.context},
          {"threads", torch::get_num_threads()},
          {"steps", steps},
          {"seconds", seconds},
          {"tokens_per_s", tps},
          {"achieved_tflops", achieved},
          {"peak_tflops", peak},
          {"peak_source", measured ? "measured " + choice_name(c.run.precision) + " matmul" : "given"},
          {"mfu", achieved / peak},
          {"peak_rss_mib", peak_rss_mib()},
          {"peak_gpu_gib", device.is_cuda() ? shim::peak_cuda_allocated_bytes(device.index() < 0 ? 0 : device.index()) / double(1 << 30) : 0.0},
          {"fused_adamw", inner.fused()},
          {"blas_core", blas_core()}};
}

}  // namespace noloco
