// Every difference between the LibTorch 2.x versions we build on lives here
// (CMake refuses anything before 2.0), with what only CUDA builds have.
#pragma once
#include <vector>

#include <ATen/autocast_mode.h>
#include <torch/torch.h>
// Usable only in CUDA builds of LibTorch.
#if __has_include(<c10/cuda/CUDACachingAllocator.h>) && __has_include(<cuda_runtime_api.h>)
#include <c10/cuda/CUDACachingAllocator.h>
#define NOLOCO_CUDA_ALLOCATOR 1
#endif

namespace noloco::shim {

// Causal scaled-dot-product attention over [B, heads, T, head_dim]: the
// fused kernel (flash / memory-efficient on CUDA).
inline torch::Tensor causal_attention(const torch::Tensor& q, const torch::Tensor& k,
                                      const torch::Tensor& v) {
  return at::scaled_dot_product_attention(q, k, v, {}, 0.0, /*is_causal=*/true);
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

// The fused multi-tensor AdamW kernel is CUDA's only (one launch updates
// every parameter, moments and weight decay included).
inline bool has_fused_adamw(const torch::Device& device) { return device.is_cuda(); }

// One AdamW step through that kernel (decoupled weight decay, no amsgrad).
// `steps` holds, per parameter, a float tensor with the step count so far.
inline void fused_adamw(std::vector<torch::Tensor>& values, std::vector<torch::Tensor>& grads,
                        std::vector<torch::Tensor>& exp_avg, std::vector<torch::Tensor>& exp_avg_sq,
                        std::vector<torch::Tensor>& steps, double lr, double beta1, double beta2,
                        double weight_decay, double eps) {
  std::vector<torch::Tensor> no_max_exp_avg_sq;
  at::_fused_adamw_(values, grads, exp_avg, exp_avg_sq, no_max_exp_avg_sq, steps, lr, beta1, beta2,
                    weight_decay, eps, /*amsgrad=*/false, /*maximize=*/false, /*grad_scale=*/{},
                    /*found_inf=*/{});
}

// Peak bytes LibTorch's caching allocator handed out on a CUDA device since the
// process started (PyTorch's torch.cuda.max_memory_allocated); 0 without CUDA.
inline double peak_cuda_allocated_bytes(int device) {
#ifdef NOLOCO_CUDA_ALLOCATOR
  // Index 0 is the aggregate over pool kinds.
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
