#pragma once

namespace noloco {

// Sets LibTorch's intra-op threads to n (cores when n <= 0) and OpenBLAS's own
// pool to 1. A second pool is faster on an idle machine and collapses on a
// busy one, because its threads spin while waiting (2 cores, threads=2,
// `bench`, pool of 2 vs 1: idle, tiny 12.6k vs 8.9k tokens/s and hidden 512
// 798 vs 504; with two busy processes beside it, tiny 588 vs 6 343 and hidden
// 512 64-144 vs 269-285). Workers share machines with other work, so the
// pool stays off unless OPENBLAS_NUM_THREADS asks for one.
void set_compute_threads(int n);
// OpenBLAS's pool size (no-op without OpenBLAS); for peak-rate measurements.
void set_blas_threads(int n);

}  // namespace noloco
