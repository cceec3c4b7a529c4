// Process-wide choices made once, first thing in main(), before LibTorch
// allocates or starts a thread (issue 18 has the measurements behind them):
//  - glibc returns freed blocks above a dynamic threshold to the OS and maps
//    them again on the next step, so every step wrote into fresh pages (page
//    faults were 17.6% of a tiny model's step). Raising the mmap and trim
//    thresholds keeps the step's memory mapped between steps.
//    NOLOCO_KEEP_MEMORY=0 keeps glibc's defaults.
//  - The soft limit on open files is raised to the hard one: a relay or a
//    worker holds a descriptor per peer.
//  - OpenMP threads spin while waiting by default; with more threads than free
//    cores (several workers on a machine, or a busy one) the spinning starved
//    the work (10x slower). Passive waiting unless OMP_WAIT_POLICY says
//    otherwise; libgomp reads it only at load time, so a process that computes
//    re-executes itself once with it set. One that only starts others (a
//    launcher, --help) does not: loading LibTorch again cost a second a run.
#pragma once
#include <string>

namespace noloco {

// Sets the variables below for this process's children; first thing in main().
void prepare_process_runtime(char** argv);

// Before this process computes with LibTorch, and before it holds anything an
// exec would leak (a lock, a child, a socket): re-executes it (execv, no
// return) when its libraries loaded without the variables; else nothing.
void reexecute_for_runtime_settings();

// The kernels OpenBLAS runs in this process ("Haswell", "SkylakeX", ...; its
// name for them), for stating with every speed figure; empty when the BLAS
// is not OpenBLAS (pip's x86 torch has MKL).
std::string blas_core();

}  // namespace noloco
