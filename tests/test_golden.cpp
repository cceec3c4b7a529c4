// Short fixed-seed runs of every method, compared exactly against losses
// recorded from an earlier version of the code (tests/golden/method_runs.json).
// They guard refactors and new options whose defaults must not change a run
// by a single bit (wire codecs at fp32 without error feedback, overlap off,
// one fragment). Recorded on pip's torch 2.13.0 (CPU) with one thread per
// worker and LibTorch's AVX2 kernels (ATen's vectorised ones, MKL's and
// oneDNN's), which every x86-64 CPU with AVX2 runs: each otherwise picks
// its kernels by CPU (AVX-512 where there is one), and other kernels round
// differently.
// To record again after an intended change of results:
//   NOLOCO_RECORD_GOLDEN=1 build/noloco_tests --gtest_filter='Golden.*'
#include <gtest/gtest.h>

#include <cstdlib>

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
  if (std::getenv("NOLOCO_RECORD_GOLDEN")) {
    write_json_atomic(kGoldenPath, measured);
    GTEST_SKIP() << "recorded " << kGoldenPath;
  }
  const auto golden = read_json(kGoldenPath);
  for (const auto& run : golden_runs()) {
    SCOPED_TRACE(run.name + ": " + run.args);
    ASSERT_TRUE(golden.contains(run.name));
    const auto& want = golden[run.name];
    const auto& got = measured[run.name];
    EXPECT_EQ(got.size(), want.size());
    ASSERT_GT(want.size(), 0u);
    for (auto& [key, loss] : want.items()) {
      ASSERT_TRUE(got.contains(key)) << key;
      EXPECT_EQ(got[key].get<double>(), loss.get<double>()) << key;  // bit for bit
    }
  }
}
