// Every difference between LibTorch 1.13 (Debian) and 2.x lives here.
#pragma once
#include <cmath>
#include <limits>
#include <stdexcept>
#include <vector>

#include <ATen/autocast_mode.h>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/torch.h>
// Usable only in CUDA builds of LibTorch (Debian ships the header without CUDA).
#if __has_include(<c10/cuda/CUDACachingAllocator.h>) && __has_include(<cuda_runtime_api.h>)
#include <c10/cuda/CUDACachingAllocator.h>
#define NOLOCO_CUDA_ALLOCATOR 1
#endif

namespace noloco::shim {

// A store's own new connection: 2.x's c10d::Store declares clone() (c10d
// calls it on stores it is given), 1.13's has none, so a store wrapping
// another shares the inner one's connection there. Stores of ours declare
// clone() without `override` for the same reason.
inline c10::intrusive_ptr<c10d::Store> clone_store(const c10::intrusive_ptr<c10d::Store>& store) {
#if TORCH_VERSION_MAJOR >= 2
  return store->clone();
#else
  return store;
#endif
}

// Causal scaled-dot-product attention over [B, heads, T, head_dim].
// 2.x has a fused kernel (flash / memory-efficient on CUDA); 1.13 has none
// public, so we spell out the math.
inline torch::Tensor causal_attention(const torch::Tensor& q, const torch::Tensor& k,
                                      const torch::Tensor& v) {
#if TORCH_VERSION_MAJOR >= 2
  return at::scaled_dot_product_attention(q, k, v, {}, 0.0, /*is_causal=*/true);
#else
  const auto T = q.size(-2);
  auto scores = torch::matmul(q, k.transpose(-2, -1)) / std::sqrt(double(q.size(-1)));
  auto mask = torch::ones({T, T}, torch::dtype(torch::kBool).device(q.device())).triu(1);
  scores = scores.masked_fill(mask, -std::numeric_limits<float>::infinity());
  return torch::matmul(torch::softmax(scores, -1), v);
#endif
}

// RMSNorm with Hugging Face's precision: statistics in (at least) fp32,
// normalised values cast back to the input's dtype before the gain. LibTorch
// >= 2.4 has it as one operator (a fused kernel on CUDA in recent versions),
// which computes the same in the input's dtype when that is fp32.
inline torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
  if (x.scalar_type() == weight.scalar_type() && x.scalar_type() == torch::kFloat32)
    return at::rms_norm(x, {x.size(-1)}, weight, eps);
#endif
  auto xf = x.to(at::promote_types(x.scalar_type(), torch::kFloat32));
  auto normed = xf * torch::rsqrt(xf.pow(2).mean(-1, /*keepdim=*/true) + eps);
  return weight * normed.to(x.scalar_type());
}

// LibTorch 2.x has a fused multi-tensor AdamW kernel for CUDA (one launch
// updates every parameter, moments and weight decay included); 1.13 has none.
inline bool has_fused_adamw(const torch::Device& device) {
#if TORCH_VERSION_MAJOR >= 2
  return device.is_cuda();
#else
  (void)device;
  return false;
#endif
}

// One AdamW step through that kernel (decoupled weight decay, no amsgrad).
// `steps` holds, per parameter, a float tensor with the step count so far.
inline void fused_adamw(std::vector<torch::Tensor>& values, std::vector<torch::Tensor>& grads,
                        std::vector<torch::Tensor>& exp_avg, std::vector<torch::Tensor>& exp_avg_sq,
                        std::vector<torch::Tensor>& steps, double lr, double beta1, double beta2,
                        double weight_decay, double eps) {
#if TORCH_VERSION_MAJOR >= 2
  std::vector<torch::Tensor> no_max_exp_avg_sq;
  at::_fused_adamw_(values, grads, exp_avg, exp_avg_sq, no_max_exp_avg_sq, steps, lr, beta1, beta2,
                    weight_decay, eps, /*amsgrad=*/false, /*maximize=*/false, /*grad_scale=*/{},
                    /*found_inf=*/{});
#else
  (void)values, (void)grads, (void)exp_avg, (void)exp_avg_sq, (void)steps, (void)lr, (void)beta1,
      (void)beta2, (void)weight_decay, (void)eps;
  throw std::logic_error("fused AdamW needs LibTorch 2.x");
#endif
}

// Peak bytes LibTorch's caching allocator handed out on a CUDA device since the
// process started (PyTorch's torch.cuda.max_memory_allocated); 0 without CUDA.
inline double peak_cuda_allocated_bytes(int device) {
#ifdef NOLOCO_CUDA_ALLOCATOR
  // Index 0 is the aggregate over pool kinds; the enum's namespace moved in 2.x.
  return double(c10::cuda::CUDACachingAllocator::getDeviceStats(device).allocated_bytes[0].peak);
#else
  (void)device;
  return 0;
#endif
}

// bf16 autocast on CUDA for the scope (matmuls in bf16, reductions in fp32,
// weights and optimizer state stay fp32). No-op when disabled.
class CudaBf16Autocast {
 public:
  explicit CudaBf16Autocast(bool enabled) : enabled_(enabled) {
    if (!enabled_) return;
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
    at::autocast::set_autocast_dtype(at::kCUDA, at::kBFloat16);
    at::autocast::set_autocast_enabled(at::kCUDA, true);
#else
    at::autocast::set_autocast_gpu_dtype(at::kBFloat16);
    at::autocast::set_enabled(true);
#endif
  }
  ~CudaBf16Autocast() {
    if (!enabled_) return;
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
    at::autocast::set_autocast_enabled(at::kCUDA, false);
#else
    at::autocast::set_enabled(false);
#endif
    at::autocast::clear_cache();
  }
  CudaBf16Autocast(const CudaBf16Autocast&) = delete;
  CudaBf16Autocast& operator=(const CudaBf16Autocast&) = delete;

 private:
  bool enabled_;
};

}  // namespace noloco::shim
