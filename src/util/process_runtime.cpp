#include "util/process_runtime.h"

#include <cstdlib>
#include <cstring>

#include <dlfcn.h>
#include <malloc.h>
#include <sys/resource.h>
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

// Links, relays and the live page hold a descriptor per peer or client, and
// Debian's soft limit (1024) is far below its hard one (a relay ran out at
// 1,000 idle strangers). Everything here polls, nothing selects, so
// descriptors past FD_SETSIZE are safe.
void use_every_descriptor_allowed() {
  rlimit files{};
  if (::getrlimit(RLIMIT_NOFILE, &files) != 0 || files.rlim_cur >= files.rlim_max) return;
  files.rlim_cur = files.rlim_max;
  ::setrlimit(RLIMIT_NOFILE, &files);
}

// OMP_WAIT_POLICY=passive unless already set; true if this set it.
bool wait_passively_in_openmp() {
  if (std::getenv("OMP_WAIT_POLICY")) return false;  // the user's choice, or our re-executed self
  setenv("OMP_WAIT_POLICY", "passive", 1);
  return true;
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
  if (wait_passively_in_openmp()) arguments_to_reexecute = argv;
  keep_freed_memory_mapped();
  use_every_descriptor_allowed();
}

void reexecute_for_runtime_settings() {
  // The variable is read only when libgomp loads. Without /proc the process
  // goes on with the library's defaults.
  if (arguments_to_reexecute) execv("/proc/self/exe", arguments_to_reexecute);
}

}  // namespace noloco
