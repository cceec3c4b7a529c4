// What sealing costs on one core: bytes per second sealed and opened
// (XChaCha20-Poly1305, comm/transport/seal.h) for payloads the size of a pipeline
// micro-batch's activations up to a model's outer message.
// Run: build/noloco_benchmarks --benchmark_filter=Seal
#include <benchmark/benchmark.h>

#include <vector>

#include "comm/transport/seal.h"

namespace {

const noloco::Seal& run_seal() {
  static const noloco::Seal seal("benchmark token");
  return seal;
}

void BM_Seal(benchmark::State& state) {
  const size_t n = size_t(state.range(0));
  std::vector<uint8_t> plain(n, 7), sealed(n + noloco::Seal::kOverhead);
  const auto context = noloco::seal_context({1, 2, 3});
  for (auto _ : state) {
    run_seal().seal(plain.data(), n, context, sealed.data());
    benchmark::DoNotOptimize(sealed.data());
  }
  state.SetBytesProcessed(int64_t(state.iterations()) * int64_t(n));
}

void BM_SealOpen(benchmark::State& state) {
  const size_t n = size_t(state.range(0));
  std::vector<uint8_t> plain(n, 7), sealed(n + noloco::Seal::kOverhead), out(n);
  const auto context = noloco::seal_context({1, 2, 3});
  run_seal().seal(plain.data(), n, context, sealed.data());
  for (auto _ : state) {
    if (!run_seal().open(sealed.data(), n, context, out.data())) state.SkipWithError("did not open");
    benchmark::DoNotOptimize(out.data());
  }
  state.SetBytesProcessed(int64_t(state.iterations()) * int64_t(n));
}

BENCHMARK(BM_Seal)->Arg(64 << 10)->Arg(1 << 20)->Arg(16 << 20);
BENCHMARK(BM_SealOpen)->Arg(64 << 10)->Arg(1 << 20)->Arg(16 << 20);

}  // namespace
