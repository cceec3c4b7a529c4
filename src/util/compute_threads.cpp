#include "util/compute_threads.h"

#include <dlfcn.h>

#include <cstdlib>
#include <thread>

#include <torch/torch.h>

namespace noloco {

void set_compute_threads(int n) {
  if (n <= 0) n = std::max(1, int(std::thread::hardware_concurrency()));
  torch::set_num_threads(n);
  // A pool the user asked for (OPENBLAS_NUM_THREADS) is theirs: for an idle machine, as PyTorch runs.
  const char* asked = std::getenv("OPENBLAS_NUM_THREADS");
  set_blas_threads(asked && std::atoi(asked) > 0 ? std::atoi(asked) : 1);
}

void set_blas_threads(int n) {
  using SetThreads = void (*)(int);
  if (auto f = reinterpret_cast<SetThreads>(::dlsym(RTLD_DEFAULT, "openblas_set_num_threads"))) f(n);
}

}  // namespace noloco
