// Overlapped and fragmented outer steps in real multi-process runs (loopback,
// bounded): checkpoints taken with exchanges in flight resume bit for bit, a
// restarted worker rejoins with them, and every fragment is applied once.
#include <gtest/gtest.h>

#include <filesystem>
#include <map>

#include <fmt/format.h>

#include "comm/link/link.h"
#include "wire/message.h"
#include "test_util.h"
#include "train/checkpoint.h"
#include "util/files.h"

using namespace noloco;
using noloco::testing::metrics_records;
using noloco::testing::small_train_args;
namespace fs = std::filesystem;

namespace {

class Overlap : public noloco::testing::LaunchedRuns {};

}  // namespace

TEST_F(Overlap, ACheckpointWithExchangesInFlightResumesBitIdentically) {
  // H = 4, F = 2: fragment 0 starts its exchange after steps 2, 6, 10, fragment 1
  // after 4, 8, 12. The checkpoint after step 6 holds both in flight.
  const std::string common =
      "method=noloco replicas=2 batch=2 steps=12 outer_interval=4 fragments=2 overlap=true decay_steps=12"
      " checkpoint_interval=3 wire_dtype=int4 topk=0.3";
  const auto whole = run("whole", common);
  const auto split = run("split", common);
  for (int r = 0; r < 2; ++r)  // the run stopped after step 6
    for (const char* later : {"step_00000009", "step_00000012"})
      fs::remove_all(fmt::format("{}/checkpoints/r{}/{}", split, r, later));
  run("split", common + " resume=true");
  noloco::testing::expect_same_train_losses(whole, split, 24);
  for (int r = 0; r < 2; ++r) {
    const auto sub = fmt::format("/checkpoints/r{}", r);
    const auto sa = load_tensors(find_checkpoint(whole + sub) + "/state.safetensors");
    const auto sb = load_tensors(find_checkpoint(split + sub) + "/state.safetensors");
    for (const char* key : {"outer.phi", "outer.momentum", "outer.start", "outer.residual.f0", "outer.residual.f1"}) {
      ASSERT_TRUE(sa.count(key)) << key;
      EXPECT_TRUE(torch::equal(sa.at(key), sb.at(key))) << key;
    }
  }
  // The saved step-6 state held both exchanges' results, to be applied later.
  const auto mid = load_tensors(whole + "/checkpoints/r0/step_00000006/state.safetensors");
  EXPECT_EQ(mid.at("outer.pending_outer_step.f0").item<int64_t>(), 1);
  EXPECT_EQ(mid.at("outer.pending_outer_step.f1").item<int64_t>(), 0);
  EXPECT_EQ(mid.count("outer.pending_flags.f0"), 0u);
}

TEST_F(Overlap, DiLoCoAppliesEachFragmentsExchangeOnceAndOnePeriodLate) {
  const auto out = run("diloco", "method=diloco replicas=2 batch=2 steps=8 outer_interval=4 fragments=2 overlap=true");
  // Exchanges start after steps 2 (f0), 4 (f1), 6 (f0), 8 (f1). Each is applied
  // at its fragment's next start, the last two when the run ends.
  std::map<int, std::vector<std::tuple<int64_t, int, int64_t>>> applied;  // replica -> (step, fragment, outer step)
  for (auto& rec : metrics_records(out, "outer"))
    applied[rec["replica"].get<int>()].emplace_back(rec["step"].get<int64_t>(), rec["fragment"].get<int>(),
                                                    rec["outer_step"].get<int64_t>());
  const std::vector<std::tuple<int64_t, int, int64_t>> want{{6, 0, 0}, {8, 1, 0}, {8, 0, 1}, {8, 1, 1}};
  ASSERT_EQ(applied.size(), 2u);
  for (auto& [replica, got] : applied) EXPECT_EQ(got, want) << "replica " << replica;
  // Fragments of 2 replicas' Δ in fp32 through one all-reduce each over a
  // sealed link (a reduce-scatter and an all-gather, one message each way):
  // the bytes of all four exchanges add up to twice the model, and 8
  // messages' headers and frames, and the link's stream header once.
  const auto summary = read_json(out + "/summary_r0.json");
  const auto params = summary["params"].get<int64_t>();
  uint64_t bytes = 0;
  for (auto& rec : metrics_records(out, "outer"))
    if (rec["replica"] == 0) bytes += rec["bytes"].get<uint64_t>();
  const uint64_t framing = Link::wire_bytes(MessageHeader::kBytes, true) + Link::wire_bytes(0, true);
  EXPECT_EQ(bytes, uint64_t(2 * 4 * params) + 4 * 2 * framing + Link::kStreamHeaderBytes);
}

// A worker killed mid-run rejoins from a live replica whose state includes an
// exchange in flight; it applies that exchange as the donor does.
TEST_F(Overlap, ARestartedWorkerRejoinsWithTheDonorsExchangeInFlight) {
  auto r = noloco::testing::run_cli(small_train_args(dir / "c.txt", dir / "rejoin") +
                                        " method=noloco replicas=3 batch=2 steps=600 outer_interval=8 fragments=2"
                                        " overlap=true eval_interval=600 inject_crash=2:20 restarts=1",
                                    150);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto summary = read_json(dir / "rejoin/summary.json");
  EXPECT_EQ(summary["replicas_finished"].get<std::vector<int>>(), (std::vector<int>{0, 1, 2}));
  const auto rejoins = metrics_records(dir / "rejoin", "rejoin");
  ASSERT_EQ(rejoins.size(), 1u);
  const auto step = rejoins[0]["step"].get<int64_t>();
  EXPECT_GT(step, 20);
  // Applied after the hand-over: the rejoined replica's first outer record is
  // the exchange its donor had in flight (an outer step before the hand-over's).
  for (auto& rec : metrics_records(dir / "rejoin", "outer"))
    if (rec["replica"] == 2 && rec["step"].get<int64_t>() > step) {
      EXPECT_EQ(rec["step"].get<int64_t>(), step + 4) << "the other fragment's next start";
      break;
    }
  EXPECT_TRUE(summary.contains("weight_std"));
  EXPECT_LT(summary["weight_std"].get<double>(), 0.05) << "the rejoined replica stays with the others";
}
