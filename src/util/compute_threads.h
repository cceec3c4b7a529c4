#pragma once

namespace noloco {

// Sets LibTorch's intra-op threads to n (cores when n <= 0) and OpenBLAS's own
// pool to 1: LibTorch already splits work across its threads, and a second
// pool per thread oversubscribes the cores (measured: 3.9k vs 11.5k tokens/s
// for `tiny` on 2 cores).
void set_compute_threads(int n);
// OpenBLAS's pool size (no-op without OpenBLAS); for peak-rate measurements.
void set_blas_threads(int n);

}  // namespace noloco
