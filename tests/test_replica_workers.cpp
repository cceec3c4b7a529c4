// Replicas of several workers (replica_workers=K): data parallel inside a
// replica, the outer method between replicas. Multi-process runs through the
// real launcher on loopback, each bounded by a timeout.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <map>

#include <fmt/format.h>

#include "test_util.h"
#include "train/checkpoint.h"
#include "util/files.h"

using namespace noloco;
using noloco::testing::metrics_records;
using noloco::testing::train_losses;

namespace {

class ReplicaWorkers : public noloco::testing::LaunchedRuns {};

// Validation losses of a run by (replica, step).
std::map<std::pair<int, int64_t>, double> val_losses(const std::string& run) {
  std::map<std::pair<int, int64_t>, double> out;
  for (auto& r : metrics_records(run, "val"))
    if (r.contains("loss")) out[{r["replica"].get<int>(), r["step"].get<int64_t>()}] = r["loss"].get<double>();
  return out;
}

// The largest difference between two runs' losses at the same (replica,
// step); both must hold exactly the same keys.
double largest_difference(const std::map<std::pair<int, int64_t>, double>& a,
                          const std::map<std::pair<int, int64_t>, double>& b) {
  EXPECT_EQ(a.size(), b.size());
  double largest = 0;
  for (const auto& [key, loss] : a) {
    const auto it = b.find(key);
    if (it == b.end()) {
      ADD_FAILURE() << "replica " << key.first << " step " << key.second << " missing";
      continue;
    }
    largest = std::max(largest, std::fabs(loss - it->second));
  }
  return largest;
}

// Float summation order: the mean of two half-batch gradients against one
// mean over the whole batch, and the all-reduce's own order.
constexpr double kSummationTolerance = 1e-5;

}  // namespace

// 2 replicas of 2 workers with batch 2 each follow 2 one-worker replicas with
// batch 4 (the same rows: worker k of replica r takes rows (2r + k)·2 on of
// the step's global batch), step by step, for both outer methods; the
// replica's weights are the same on its two workers at the end.
TEST_F(ReplicaWorkers, TwoWorkersAReplicaFollowOneWorkerWithTwiceTheBatch) {
  for (const std::string method : {"diloco", "noloco"}) {
    SCOPED_TRACE(method);
    const std::string common = "method=" + method + " replicas=2 steps=12 outer_interval=4 eval_interval=4";
    const auto split = run(method + "_2x2", common + " replica_workers=2 batch=2");
    const auto whole = run(method + "_2x1", common + " batch=4");
    const auto train_a = train_losses(split), train_b = train_losses(whole);
    ASSERT_EQ(train_b.size(), 24u);
    const double train_gap = largest_difference(train_a, train_b);
    const double val_gap = largest_difference(val_losses(split), val_losses(whole));
    ASSERT_EQ(val_losses(whole).size(), 6u);
    std::printf("%s: largest train-loss difference %.3g, val-loss %.3g over %zu logged steps\n", method.c_str(),
                train_gap, val_gap, train_b.size());
    EXPECT_LT(train_gap, kSummationTolerance);
    EXPECT_LT(val_gap, kSummationTolerance);
    EXPECT_EQ(metrics_records(split, "outer").size(), metrics_records(whole, "outer").size());
    // One checkpoint per replica, written by its first worker, close to the one-worker replica's.
    for (int r = 0; r < 2; ++r) {
      EXPECT_FALSE(std::filesystem::exists(fmt::format("{}/checkpoints/r{}", split, 2 * r + 1)));
      const auto a = load_tensors(find_checkpoint(fmt::format("{}/checkpoints/r{}", split, 2 * r)) + "/model.safetensors");
      const auto b = load_tensors(find_checkpoint(fmt::format("{}/checkpoints/r{}", whole, r)) + "/model.safetensors");
      for (auto& [name, t] : a) EXPECT_LT((t - b.at(name)).abs().max().item<double>(), 1e-4) << name;
    }
    const auto summary = read_json(split + "/summary.json");
    EXPECT_EQ(summary["replicas_finished"].get<std::vector<int>>(), (std::vector<int>{0, 1}));
    EXPECT_EQ(summary["tokens"], read_json(whole + "/summary.json")["tokens"]) << "a replica's tokens, all its workers'";
    // Issue 67 item 8: one summary per replica (r0, r1), its workers listed inside.
    EXPECT_FALSE(std::filesystem::exists(split + "/summary_r2.json"));
    for (int r = 0; r < 2; ++r) {
      const auto replica = read_json(fmt::format("{}/summary_r{}.json", split, r));
      EXPECT_TRUE(replica["final_val_loss"].is_number()) << replica.dump();
      ASSERT_EQ(replica["workers"].size(), 2u) << replica.dump();
      for (int k = 0; k < 2; ++k) {
        const auto& worker = replica["workers"][size_t(k)];
        EXPECT_EQ(worker["worker"].get<int>(), 2 * r + k);
        EXPECT_EQ(worker["device"].get<std::string>(), "cpu");
        EXPECT_GT(worker["peak_rss_mib"].get<double>(), 0);
        EXPECT_LE(worker["peak_rss_mib"].get<double>(), replica["peak_rss_mib"].get<double>());
      }
    }
  }
}

// The replica's first worker sends for it: a 2x2 NoLoCo run moves exactly the
// bytes between replicas that a 2x1 run does, outer step for outer step. With
// overlap and fragments the weights change one period after an exchange, a
// slice at a time: the other workers still follow (the losses agree).
TEST_F(ReplicaWorkers, ReplicasOfTwoWorkersSendWhatOneWorkerReplicasSend) {
  const std::string common =
      "method=noloco replicas=2 steps=16 outer_interval=4 compression=topk overlap=true fragments=2";
  const auto split = run("split", common + " replica_workers=2 batch=2");
  const auto whole = run("whole", common + " batch=4");
  const auto a = read_json(split + "/summary.json"), b = read_json(whole + "/summary.json");
  EXPECT_GT(b["bytes_sent"].get<uint64_t>(), 0u);
  EXPECT_EQ(a["bytes_sent"].get<uint64_t>(), b["bytes_sent"].get<uint64_t>());
  EXPECT_EQ(a["bits_per_param_per_inner_step"].get<double>(), b["bits_per_param_per_inner_step"].get<double>());
  std::map<std::pair<int, int64_t>, uint64_t> sent_a, sent_b;
  for (auto& r : metrics_records(split, "outer")) sent_a[{r["replica"], r["outer_step"]}] = r["bytes"];
  for (auto& r : metrics_records(whole, "outer")) sent_b[{r["replica"], r["outer_step"]}] = r["bytes"];
  EXPECT_EQ(sent_a, sent_b);
  EXPECT_LT(largest_difference(train_losses(split), train_losses(whole)), kSummationTolerance);
}

// Stopped after 6 steps and resumed, a 2x2 NoLoCo run logs the losses of the
// run that never stopped, bit for bit.
TEST_F(ReplicaWorkers, AResumedRunIsBitIdentical) {
  const std::string common =
      "method=noloco replicas=2 replica_workers=2 batch=2 outer_interval=3 decay_steps=12 checkpoint_interval=3";
  const auto whole = run("whole", common + " steps=12");
  run("split", common + " steps=6");
  const auto split = run("split", common + " steps=12 resume=true");
  noloco::testing::expect_same_train_losses(whole, split, 24);
}

// Issue 105: a replica of two workers is paced as one. Replica 1, whose
// steps take four times as long, trains about a quarter of the slots once
// it has heard replica 0's pace: its first worker decides, and both skip the
// same slots (else one would wait in the gradients' all-reduce and the run
// would not finish).
TEST_F(ReplicaWorkers, AReplicaOfTwoWorkersIsPacedAsOne) {
  for (const std::string method : {"diloco", "noloco"}) {
    SCOPED_TRACE(method);
    const auto paced = run(method, "method=" + method + " replicas=2 replica_workers=2 batch=2 steps=60 "
                                                         "outer_interval=10 pace=speed slowdown=1:4");
    int weighed = 0;
    for (auto& rec : metrics_records(paced, "outer")) {
      ASSERT_TRUE(rec.contains("trained_steps")) << rec.dump();
      if (rec["replica"] == 1 && rec["outer_step"].get<int>() >= 3) {
        EXPECT_LE(rec["trained_steps"].get<int>(), 5) << rec.dump();
        ++weighed;
      }
    }
    EXPECT_GE(weighed, 3) << "replica 1 spoke at its outer steps 3 to 6";
    const auto slow = read_json(paced + "/summary_r1.json"), fast = read_json(paced + "/summary_r0.json");
    EXPECT_LT(slow["tokens"].get<double>(), 0.6 * fast["tokens"].get<double>());
    EXPECT_EQ(read_json(paced + "/summary.json")["replicas_finished"].get<std::vector<int>>(),
              (std::vector<int>{0, 1}));
  }
}

// A killed worker takes its replica out (its group's collectives fail); the
// other replica finishes, and the run ends as a NoLoCo run that lost a replica.
TEST_F(ReplicaWorkers, AKilledWorkerTakesItsReplicaOutAndTheOtherFinishes) {
  auto r = noloco::testing::run_cli(noloco::testing::small_train_args(dir / "c.txt", dir / "crash") +
                                        " method=noloco replicas=2 replica_workers=2 batch=2 steps=30 "
                                        "outer_interval=3 inject_crash=3:8",
                                    120);
  EXPECT_EQ(r.exit_code, 3) << "finished, but not whole: " << r.output;
  EXPECT_NE(r.output.find("worker 3 was killed by signal 9"), std::string::npos) << r.output;
  // Its replica's other worker is stopped by the launcher (the first of the two reaped names the other).
  EXPECT_NE(r.output.find("its replica lost worker"), std::string::npos) << r.output;
  const auto summary = read_json(dir / "crash/summary.json");
  EXPECT_EQ(summary["replicas_finished"].get<std::vector<int>>(), (std::vector<int>{0}));
  ASSERT_GE(summary["replicas_failed"].size(), 1u);
  for (auto& f : summary["replicas_failed"]) EXPECT_EQ(f["replica"].get<int>(), 1) << f.dump();
  EXPECT_TRUE(summary.contains("final_val_loss"));
  const auto losses = train_losses(dir / "crash");
  EXPECT_TRUE(losses.count({0, 30})) << "replica 0 trained to the end";
  EXPECT_FALSE(losses.count({1, 30}));
}

// With restarts=1 a replica that lost a worker is restarted whole: its first
// worker takes a live replica's state after that replica's next outer step
// and hands it to the other over the replica's group, formed anew; the
// replica trains on to the end and averages with its partner again.
TEST_F(ReplicaWorkers, AReplicaThatLostAWorkerIsRestartedWholeAndTrainsOn) {
  auto r = noloco::testing::run_cli(noloco::testing::small_train_args(dir / "c.txt", dir / "restart") +
                                        " method=noloco replicas=2 replica_workers=2 batch=2 steps=300 "
                                        "outer_interval=10 eval_interval=150 inject_crash=3:25 restarts=1",
                                    180);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("restarting replica 1 (its 2 workers)"), std::string::npos) << r.output;
  const auto summary = read_json(dir / "restart/summary.json");
  EXPECT_EQ(summary["replicas_finished"].get<std::vector<int>>(), (std::vector<int>{0, 1}));
  EXPECT_TRUE(summary["replicas_failed"].empty()) << summary.dump();
  ASSERT_EQ(summary["replicas_restarted"].size(), 2u) << "both of its workers: " << summary.dump();
  for (auto& w : summary["replicas_restarted"]) EXPECT_EQ(w["replica"].get<int>(), 1) << w.dump();

  const auto rejoins = metrics_records(dir / "restart", "rejoin");
  ASSERT_EQ(rejoins.size(), 1u) << "its first worker speaks for the replica";
  const auto step = rejoins[0]["step"].get<int64_t>();
  EXPECT_EQ(rejoins[0]["replica"], 1);
  EXPECT_EQ(rejoins[0]["donor"], 0);
  EXPECT_GT(step, 25) << "the state comes from the live replica, not from before the crash";
  EXPECT_EQ(step % 10, 0) << "handed over after an outer step";
  // Both workers start at the donor's step: the replica's first logged step
  // after the crash is the next one (a worker out of step would hang the group).
  const auto losses = train_losses(dir / "restart");
  int64_t first_after = -1;
  for (auto& [key, loss] : losses)
    if (key.first == 1 && key.second > 25 && first_after < 0) first_after = key.second;
  EXPECT_EQ(first_after, step + 1);
  ASSERT_TRUE(losses.count({1, 300}) && losses.count({0, 300}));
  EXPECT_NEAR(losses.at({1, 300}), losses.at({0, 300}), 0.1 * losses.at({0, 300})) << "averaged with replica 0 again";
  bool averaged_with_a_partner = false;
  for (auto& rec : metrics_records(dir / "restart", "outer"))
    if (rec["replica"] == 1 && rec["step"].get<int64_t>() > step && rec["arrived"].size() > 1)
      averaged_with_a_partner = true;
  EXPECT_TRUE(averaged_with_a_partner);
}

// `noloco join` of a run whose replicas have two workers brings a whole
// replica: its first worker claims the member id and starts the other; the
// first takes a live replica's state and hands it on over their group; the
// new replica is drawn into the groupings and finishes with the others.
TEST_F(ReplicaWorkers, AJoinerBringsAWholeReplica) {
  const std::string run_dir = dir / "grow";
  noloco::testing::BackgroundCli runner(
      noloco::testing::small_train_args(dir / "c.txt", run_dir) +
          " method=noloco replicas=2 replica_workers=2 batch=2 steps=800 outer_interval=5 heartbeat_timeout=60 "
          "threads=1",
      300);
  ASSERT_TRUE(noloco::testing::wait_for_step(run_dir, 100, 120));
  const auto joiner = noloco::testing::run_cli("join " + run_dir + " threads=1", 280);
  const auto& r = runner.wait();
  ASSERT_EQ(r.exit_code, 0) << r.output;
  ASSERT_EQ(joiner.exit_code, 0) << joiner.output;
  EXPECT_NE(joiner.output.find("as replica 2 of 2 workers"), std::string::npos) << joiner.output;
  const auto summary = read_json(run_dir + "/summary.json");
  EXPECT_EQ(summary["replicas_finished"].get<std::vector<int>>(), (std::vector<int>{0, 1, 2})) << summary.dump();
  EXPECT_TRUE(summary["replicas_failed"].empty()) << summary.dump();
  ASSERT_EQ(summary["joined"].size(), 1u) << summary.dump();
  EXPECT_EQ(summary["joined"][0]["replica"], 2);
  EXPECT_EQ(summary["joined"][0]["step"].get<int64_t>() % 5, 0) << "handed over after an outer step";
  const auto replica = read_json(run_dir + "/summary_r2.json");
  EXPECT_TRUE(replica.contains("rejoined_at_step")) << "its first worker took a live replica's state";
  ASSERT_EQ(replica["workers"].size(), 2u) << replica.dump();
  EXPECT_EQ(replica["workers"][0]["worker"], 4);
  EXPECT_EQ(replica["workers"][1]["worker"], 5);
  EXPECT_FALSE(std::filesystem::exists(run_dir + "/summary_r4.json")) << "summaries are per replica";
  bool paired_with_joiner = false;
  for (auto& o : metrics_records(run_dir, "outer"))
    if (o["replica"].get<int>() < 2)
      for (int member : o["group"].get<std::vector<int>>()) paired_with_joiner |= member == 2;
  EXPECT_TRUE(paired_with_joiner);
  const double joined = replica["final_val_loss"].get<double>();
  const double first = read_json(run_dir + "/summary_r0.json")["final_val_loss"].get<double>();
  EXPECT_NEAR(joined, first, 0.02 * first);
}

// What is not built yet is refused in one line, before any worker starts.
TEST_F(ReplicaWorkers, WhatIsNotBuiltIsRefusedInOneLine) {
  const auto args = noloco::testing::small_train_args(dir / "c.txt", dir / "refused") + " replicas=2 replica_workers=2 ";
  for (const auto& [extra, expected] : std::vector<std::pair<std::string, std::string>>{
           {"method=noloco stages=2", "replica_workers > 1 with pipeline stages is not implemented"},
           {"method=ddp", "use replicas=4 instead"},
           {"method=noloco replica_workers=0", "replica_workers must be positive"}}) {
    const auto r = noloco::testing::run_cli(args + extra, 60);
    EXPECT_NE(r.exit_code, 0) << extra;
    EXPECT_NE(r.output.find(expected), std::string::npos) << extra << ": " << r.output;
    EXPECT_FALSE(std::filesystem::exists(dir / "refused/summary.json"));
  }
}
