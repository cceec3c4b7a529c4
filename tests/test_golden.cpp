// Short fixed-seed runs of every method, compared exactly against losses
// recorded from an earlier version of the code (tests/golden/method_runs.json).
// They guard refactors and new options whose defaults must not change a run
// by a single bit (wire codecs at fp32 without error feedback, overlap off,
// one fragment). Recorded on pip's torch 2.13.0 (CPU) with one thread per
// worker and LibTorch's AVX2 kernels (ATen's vectorised ones, MKL's and
// oneDNN's), which every x86-64 CPU with AVX2 runs: each otherwise picks
// its kernels by CPU (AVX-512 where there is one), and other kernels round
// differently. Pinned so, the losses still differ in their last bits between
// an AMD EPYC and an Intel Xeon (MKL promises its AVX2 path's results only
// across Intel's CPUs), so there is one recording per CPU vendor: a run
// matches its own vendor's bit for bit and the others' to
// kCrossVendorTolerance.
// To record again after an intended change of results (on each vendor's CPU):
//   NOLOCO_RECORD_GOLDEN=1 build/noloco_tests --gtest_filter='Golden.*'
#include <cpuid.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>

#include <fmt/format.h>

#include "test_util.h"
#include "util/files.h"

using namespace noloco;
using noloco::testing::metrics_records;
using noloco::testing::small_train_args;
using noloco::testing::TempDir;

namespace {

struct GoldenRun {
  std::string name, args;
};

const std::vector<GoldenRun>& golden_runs() {
  static const std::vector<GoldenRun> runs = {
      {"none", "batch=4 steps=12"},
      {"ddp", "method=ddp replicas=2 batch=2 steps=8"},
      {"diloco", "method=diloco replicas=2 batch=2 steps=12 outer_interval=4"},
      {"noloco", "method=noloco replicas=4 batch=2 steps=12 outer_interval=4"},
      {"noloco_gamma", "method=noloco replicas=2 batch=2 steps=12 outer_interval=4 gamma=0.4"},
      {"noloco_bf16", "method=noloco replicas=2 batch=2 steps=12 outer_interval=4 wire_dtype=bf16"},
      {"pipeline", "method=noloco replicas=2 stages=2 batch=2 grad_accum=2 steps=8 outer_interval=4 activation_codec=fp32"},
  };
  return runs;
}

// Every train and validation loss of a run, keyed by split, worker and step.
nlohmann::json losses_of(const std::string& run_dir) {
  nlohmann::json out = nlohmann::json::object();
  for (const char* split : {"train", "val"})
    for (auto& r : metrics_records(run_dir, split)) {
      if (!r.contains("loss")) continue;  // pipeline stages that do not compute the loss
      const int worker = r.value("worker", r.value("replica", 0));
      out[fmt::format("{}/w{}/s{}", split, worker, r["step"].get<int64_t>())] = r["loss"];
    }
  return out;
}

const std::string kGoldenPath = std::string(NOLOCO_SOURCE_DIR) + "/tests/golden/method_runs.json";

// Losses of the same run on another vendor's CPU differ by rounding alone
// (at most 4.8e-7 between the two recordings, 160 of 179 identical).
constexpr double kCrossVendorTolerance = 1e-5;

// "GenuineIntel", "AuthenticAMD", ...: the CPU's vendor as CPUID names it.
std::string cpu_vendor() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__get_cpuid(0, &eax, &ebx, &ecx, &edx)) return "unknown";
  char name[13] = {};
  std::memcpy(name, &ebx, 4);
  std::memcpy(name + 4, &edx, 4);
  std::memcpy(name + 8, &ecx, 4);
  return name;
}

// Every run's losses against `want`'s, to within `tolerance` (0: bit for bit).
void expect_losses(const nlohmann::json& measured, const nlohmann::json& want, double tolerance) {
  for (const auto& run : golden_runs()) {
    SCOPED_TRACE(run.name + ": " + run.args);
    ASSERT_TRUE(want.contains(run.name));
    const auto& expected = want[run.name];
    const auto& got = measured[run.name];
    EXPECT_EQ(got.size(), expected.size());
    ASSERT_GT(expected.size(), 0u);
    for (auto& [key, loss] : expected.items()) {
      ASSERT_TRUE(got.contains(key)) << key;
      if (tolerance == 0)
        EXPECT_EQ(got[key].get<double>(), loss.get<double>()) << key;
      else
        EXPECT_NEAR(got[key].get<double>(), loss.get<double>(), tolerance) << key;
    }
  }
}

}  // namespace

TEST(Golden, EveryMethodReproducesTheRecordedLossesExactly) {
#if defined(__x86_64__)
  if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma"))
    GTEST_SKIP() << "the losses were recorded with AVX2 kernels, which need AVX2 and FMA";
#else
  GTEST_SKIP() << "the losses were recorded with x86-64 AVX2 kernels";
#endif
  // The runs are child processes: they inherit these, this process keeps its kernels.
  setenv("ATEN_CPU_CAPABILITY", "avx2", 1);
  setenv("MKL_CBWR", "AVX2", 1);
  setenv("ONEDNN_MAX_CPU_ISA", "AVX2", 1);
  TempDir dir;
  noloco::testing::write_text(dir / "c.txt", noloco::testing::shakespeare(20000));
  nlohmann::json measured = nlohmann::json::object();
  for (const auto& run : golden_runs()) {
    const auto r =
        noloco::testing::run_cli(small_train_args(dir / "c.txt", dir / run.name) + " threads=1 " + run.args, 120);
    ASSERT_EQ(r.exit_code, 0) << run.name << ": " << r.output;
    measured[run.name] = losses_of(dir / run.name);
  }
  const auto vendor = cpu_vendor();
  auto golden = read_json(kGoldenPath);
  if (std::getenv("NOLOCO_RECORD_GOLDEN")) {
    golden[vendor] = measured;
    write_json_atomic(kGoldenPath, golden);
    GTEST_SKIP() << "recorded " << vendor << "'s losses in " << kGoldenPath;
  }
  // A vendor with no recording of its own is held to the others' within the tolerance.
  ASSERT_GT(golden.size(), 0u);
  for (auto& [other, losses] : golden.items()) {
    SCOPED_TRACE("recorded on " + other + "'s CPU");
    expect_losses(measured, losses, other == vendor ? 0 : kCrossVendorTolerance);
  }
}
