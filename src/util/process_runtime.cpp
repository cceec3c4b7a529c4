#include "util/process_runtime.h"

#include <cstdlib>
#include <cstring>

#include <malloc.h>
#include <unistd.h>

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

void wait_passively_in_openmp(char** argv) {
  if (std::getenv("OMP_WAIT_POLICY")) return;  // the user's choice, or our re-executed self
  setenv("OMP_WAIT_POLICY", "passive", 1);
  execv("/proc/self/exe", argv);
  // Without /proc the process goes on with OpenMP's default policy.
}

}  // namespace

void prepare_process_runtime(char** argv) {
  wait_passively_in_openmp(argv);
  keep_freed_memory_mapped();
}

}  // namespace noloco
