#include "util/process_runtime.h"

#include <cstdlib>
#include <cstring>

#include <dlfcn.h>
#include <malloc.h>
#include <strings.h>
#include <unistd.h>

#if defined(__x86_64__)
#include <cpuid.h>
#endif

namespace noloco {

namespace {

void keep_freed_memory_mapped() {
  const char* keep = std::getenv("NOLOCO_KEEP_MEMORY");
  if (keep && std::strcmp(keep, "0") == 0) return;
  // 32 MiB is glibc's largest mmap threshold on 64-bit: blocks up to it come
  // from the heap and are reused; trimming waits for 512 MiB free at the top.
  mallopt(M_MMAP_THRESHOLD, 32 << 20);
  mallopt(M_TRIM_THRESHOLD, 512 << 20);
}

// OMP_WAIT_POLICY=passive unless already set; true if this set it.
bool wait_passively_in_openmp() {
  if (std::getenv("OMP_WAIT_POLICY")) return false;  // the user's choice, or our re-executed self
  setenv("OMP_WAIT_POLICY", "passive", 1);
  return true;
}

#if defined(__x86_64__)
// AVX2 with FMA, and AVX-512 (F, CD, BW, DQ, VL) where the OS saves its state.
struct VectorUnits {
  bool avx2 = false, avx512 = false;
};

VectorUnits vector_units() {
  VectorUnits v;
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & bit_OSXSAVE) || !(c & bit_FMA)) return v;
  unsigned lo, hi;
  __asm__("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  const bool ymm = (lo & 0x6) == 0x6, zmm = (lo & 0xe6) == 0xe6;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return v;
  v.avx2 = ymm && (b & bit_AVX2);
  const unsigned avx512 = bit_AVX512F | bit_AVX512CD | bit_AVX512BW | bit_AVX512DQ | bit_AVX512VL;
  v.avx512 = v.avx2 && zmm && (b & avx512) == avx512;
  return v;
}
#endif

// OpenBLAS picks its kernels from the CPU model, and Debian 12's (0.3.21)
// does not know newer ones: on a Xeon with AVX-512 it fell back to its
// Prescott (SSE3) kernels and a tiny model's step ran 3.3x slower than with
// its SkylakeX ones (docs/results-log.md). It reads OPENBLAS_CORETYPE only at load
// time, so the process re-executes itself with it set. Only that fallback is
// corrected: a core OpenBLAS recognised, or the user's OPENBLAS_CORETYPE,
// stays. True if this set it.
bool use_the_blas_kernels_this_cpu_runs() {
#if defined(__x86_64__)
  if (std::getenv("OPENBLAS_CORETYPE")) return false;
  const std::string core = blas_core();
  if (core.empty()) return false;  // not OpenBLAS
  static const char* const vector_cores[] = {"haswell", "zen", "skylakex", "cooperlake", "sapphirerapids"};
  for (const char* vector_core : vector_cores)
    if (strcasecmp(core.c_str(), vector_core) == 0) return false;
  const VectorUnits v = vector_units();
  if (!v.avx2) return false;
  setenv("OPENBLAS_CORETYPE", v.avx512 ? "SkylakeX" : "Haswell", 1);
  return true;
#else
  return false;
#endif
}

}  // namespace

std::string blas_core() {
  using CoreName = char* (*)();
  const auto core_name = reinterpret_cast<CoreName>(::dlsym(RTLD_DEFAULT, "openblas_get_corename"));
  const char* core = core_name ? core_name() : nullptr;
  return core ? core : "";
}

namespace {
// This process's arguments, when its libraries loaded without the variables it set.
char** arguments_to_reexecute = nullptr;
}  // namespace

void prepare_process_runtime(char** argv) {
  const bool openmp = wait_passively_in_openmp();
  const bool blas = use_the_blas_kernels_this_cpu_runs();
  if (openmp || blas) arguments_to_reexecute = argv;
  keep_freed_memory_mapped();
}

void compute_in_this_process() {
  // Both variables are read only when their libraries load. Without /proc the
  // process goes on with the libraries' defaults.
  if (arguments_to_reexecute) execv("/proc/self/exe", arguments_to_reexecute);
}

}  // namespace noloco
