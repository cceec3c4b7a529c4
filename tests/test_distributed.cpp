// Multi-process runs through the real launcher and c10d on loopback; each
// bounded by `timeout` so a hang fails the test instead of CI.
#include <gtest/gtest.h>

#include <map>
#include <set>
#include <sstream>
#include <random>
#include <thread>

#include <fmt/format.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>

#include <nlohmann/json.hpp>

#include "comm/link/link.h"
#include "comm/transport/seal.h"
#include "etcd_cluster.h"
#include "test_util.h"
#include "comm/store/etcd_server.h"
#include "comm/store/run_keys.h"
#include "wire/message.h"
#include "train/checkpoint.h"
#include "train/evaluation.h"
#include "util/files.h"

using namespace noloco;
using noloco::testing::metrics_records;
using noloco::testing::wait_for_step;
using noloco::testing::small_train_args;

namespace {

class Distributed : public noloco::testing::LaunchedRuns {};

}  // namespace

TEST_F(Distributed, DdpMatchesOneReplicaWithTheCombinedBatch) {
  const auto ddp = run("ddp", "method=ddp replicas=2 batch=4 steps=10");
  const auto single = run("single", "batch=8 steps=10");
  std::map<int64_t, std::vector<double>> per_step;
  for (auto& r : metrics_records(ddp, "train")) per_step[r["step"].get<int64_t>()].push_back(r["loss"].get<double>());
  const auto reference = metrics_records(single, "train");
  ASSERT_EQ(reference.size(), 10u);
  for (auto& r : reference) {
    const auto& losses = per_step.at(r["step"].get<int64_t>());
    ASSERT_EQ(losses.size(), 2u);
    EXPECT_NEAR((losses[0] + losses[1]) / 2, r["loss"].get<double>(), 1e-5) << "step " << r["step"];
  }
  const auto a = load_tensors(find_checkpoint(ddp + "/checkpoints/r1") + "/model.safetensors");
  const auto b = load_tensors(find_checkpoint(single) + "/model.safetensors");
  for (auto& [name, t] : a) EXPECT_LT((t - b.at(name)).abs().max().item<double>(), 1e-5) << name;
  const auto summary = read_json(ddp + "/summary.json");
  EXPECT_EQ(summary["collectives"].get<int64_t>(), 2 * 10);  // one bucket per step per replica
}

TEST_F(Distributed, NoLoCoWithTheWholeGroupEqualsDiLoCo) {
  const std::string common = "replicas=2 batch=4 steps=15 outer_interval=5 outer_momentum=0.5 outer_lr=0.7";
  const auto noloco = run("noloco", "method=noloco group_size=2 " + common);
  const auto diloco = run("diloco", "method=diloco " + common);
  for (int r = 0; r < 2; ++r) {
    const auto sub = "/checkpoints/r" + std::to_string(r);
    const auto a = load_tensors(find_checkpoint(noloco + sub) + "/model.safetensors");
    const auto b = load_tensors(find_checkpoint(diloco + sub) + "/model.safetensors");
    for (auto& [name, t] : a) EXPECT_LT((t - b.at(name)).abs().max().item<double>(), 1e-6) << name;
  }
  EXPECT_EQ(metrics_records(noloco, "outer").size(), 2u * 3u);
}

// On slow links the weight spread and the mean model's loss (a weight-sized
// mean across replicas) can be measured less often than the validation loss;
// the last validation always has them, so the summary does, and its spread is
// the one the final checkpoints give.
TEST_F(Distributed, TheSpreadIsMeasuredEverySpreadIntervalAndAtTheEnd) {
  const auto run_dir = run("spread", "method=noloco replicas=2 batch=2 steps=10 outer_interval=4 eval_interval=2 "
                                     "spread_interval=4");
  std::map<int, std::set<int64_t>> validated, spread;
  for (auto& r : metrics_records(run_dir, "val")) {
    validated[r["replica"].get<int>()].insert(r["step"].get<int64_t>());
    if (r.contains("weight_std")) spread[r["replica"].get<int>()].insert(r["step"].get<int64_t>());
  }
  for (int replica : {0, 1}) {
    EXPECT_EQ(validated[replica], (std::set<int64_t>{2, 4, 6, 8, 10}));
    EXPECT_EQ(spread[replica], (std::set<int64_t>{4, 8, 10})) << "replica " << replica;
  }
  const auto summary = read_json(run_dir + "/summary.json");
  EXPECT_TRUE(summary.contains("final_val_loss_mean_model"));
  // Two replicas a and b: each deviates from their mean by (a − b)/2.
  const auto a = load_tensors(find_checkpoint(run_dir + "/checkpoints/r0") + "/model.safetensors");
  const auto b = load_tensors(find_checkpoint(run_dir + "/checkpoints/r1") + "/model.safetensors");
  double squares = 0, count = 0;
  for (auto& [name, t] : a) {
    squares += ((t.to(torch::kFloat64) - b.at(name).to(torch::kFloat64)) / 2).square().sum().item<double>();
    count += double(t.numel());
  }
  ASSERT_TRUE(summary.contains("weight_std"));
  ASSERT_GT(squares, 0.0) << "the replicas differ two inner steps after their last outer step";
  EXPECT_NEAR(summary["weight_std"].get<double>(), std::sqrt(squares / count), 1e-4 * std::sqrt(squares / count));
}

// Of more replicas than eval.spread_replicas, the spread and the mean model
// are of a sample: the first live replica and a draw every replica makes
// alike; the others skip them, and the summary says k of N.
TEST_F(Distributed, TheSpreadOfManyReplicasIsOfASampleDrawnAlikeEverywhere) {
  const auto run_dir = run("sampled", "method=noloco replicas=4 spread_replicas=2 batch=2 steps=10 outer_interval=4 "
                                      "eval_interval=5 seed=11");
  std::vector<Peer> members;
  for (int r = 0; r < 4; ++r) members.push_back({r, 0});
  for (const int64_t step : {5, 10}) {
    std::set<int> sampled;
    for (auto& r : metrics_records(run_dir, "val")) {
      if (r["step"].get<int64_t>() != step || !r.contains("weight_std")) continue;
      sampled.insert(r["replica"].get<int>());
      EXPECT_EQ(r["spread_replicas"].get<int>(), 2);
      EXPECT_EQ(r["live_replicas"].get<int>(), 4);
    }
    std::set<int> expected;
    for (const auto& p : spread_sample(11, step, members, 2)) expected.insert(p.rank);
    EXPECT_EQ(sampled, expected) << "step " << step;
    EXPECT_EQ(sampled.count(0), 1u) << "the first live replica evaluates the mean model";
  }
  const auto summary = read_json(run_dir + "/summary.json");
  EXPECT_EQ(summary["spread_replicas"].get<int>(), 2);
  EXPECT_EQ(summary["live_replicas"].get<int>(), 4);
  EXPECT_TRUE(summary.contains("final_val_loss_mean_model"));
  // Two replicas a and b: each deviates from their mean by (a − b)/2.
  const auto last = spread_sample(11, 10, members, 2);
  const auto a = load_tensors(find_checkpoint(fmt::format("{}/checkpoints/r{}", run_dir, last[0].rank)) +
                              "/model.safetensors");
  const auto b = load_tensors(find_checkpoint(fmt::format("{}/checkpoints/r{}", run_dir, last[1].rank)) +
                              "/model.safetensors");
  double squares = 0, count = 0;
  for (auto& [name, t] : a) {
    squares += ((t.to(torch::kFloat64) - b.at(name).to(torch::kFloat64)) / 2).square().sum().item<double>();
    count += double(t.numel());
  }
  ASSERT_GT(squares, 0.0);
  EXPECT_NEAR(summary["weight_std"].get<double>(), std::sqrt(squares / count), 1e-4 * std::sqrt(squares / count));
}

TEST_F(Distributed, NoLoCoGroupsPartitionNoCollectivesModelSizedMessages) {
  const auto run_dir = run("noloco4", "method=noloco replicas=4 batch=2 steps=12 outer_interval=3");
  std::map<int64_t, std::map<int, std::vector<int>>> groups;  // outer step -> replica -> its group
  for (auto& r : metrics_records(run_dir, "outer"))
    groups[r["outer_step"].get<int64_t>()][r["replica"].get<int>()] = r["group"].get<std::vector<int>>();
  ASSERT_EQ(groups.size(), 4u);
  std::set<std::vector<std::vector<int>>> distinct;
  for (auto& [step, by_replica] : groups) {
    ASSERT_EQ(by_replica.size(), 4u) << "outer step " << step;
    std::set<std::vector<int>> partition;
    std::multiset<int> members;
    for (auto& [replica, group] : by_replica) {
      EXPECT_TRUE(std::count(group.begin(), group.end(), replica)) << "replica outside its own group";
      for (int other : group) EXPECT_EQ(by_replica.at(other), group) << "replicas disagree on the grouping";
      if (partition.insert(group).second) members.insert(group.begin(), group.end());
    }
    EXPECT_EQ(members, (std::multiset<int>{0, 1, 2, 3}));
    distinct.insert({partition.begin(), partition.end()});
  }
  EXPECT_GT(distinct.size(), 1u) << "the grouping never changed";

  const auto summary = read_json(run_dir + "/summary.json");
  EXPECT_EQ(summary["collectives"].get<int64_t>(), 0);
  const auto r0 = read_json(run_dir + "/summary_r0.json");
  const uint64_t fp32_model_bytes = 4 * r0["params"].get<uint64_t>();
  // One model per outer step and its header, each a sealed message on a
  // link (comm/link/link.h), and a stream header on each link opened: one
  // per partner, kept while both ends hold it.
  std::set<int> partners;
  for (auto& [step, by_replica] : groups)
    for (int member : by_replica.at(0))
      if (member != 0) partners.insert(member);
  auto exchange_bytes = [](uint64_t payload) {
    return Link::wire_bytes(MessageHeader::kBytes, true) + Link::wire_bytes(payload, true);
  };
  EXPECT_EQ(r0["bytes_sent"].get<uint64_t>(),
            4 * exchange_bytes(fp32_model_bytes) + partners.size() * Link::kStreamHeaderBytes);

  const auto bf16 = run("bf16", "method=noloco replicas=2 batch=2 steps=6 outer_interval=3 wire_dtype=bf16");
  EXPECT_EQ(read_json(bf16 + "/summary_r1.json")["bytes_sent"].get<uint64_t>(),
            2 * exchange_bytes(fp32_model_bytes / 2) + Link::kStreamHeaderBytes);
}

TEST_F(Distributed, MultiReplicaNoLoCoResumesBitIdentically) {
  const std::string common = "method=noloco replicas=2 batch=2 outer_interval=3 decay_steps=12 checkpoint_interval=3";
  const auto whole = run("whole", common + " steps=12");
  run("split", common + " steps=6");
  const auto split = run("split", common + " steps=12 resume=true");
  noloco::testing::expect_same_train_losses(whole, split, 24);
  for (int r = 0; r < 2; ++r) {
    const auto sub = "/checkpoints/r" + std::to_string(r);
    const auto wa = load_tensors(find_checkpoint(whole + sub) + "/state.safetensors");
    const auto wb = load_tensors(find_checkpoint(split + sub) + "/state.safetensors");
    EXPECT_TRUE(torch::equal(wa.at("outer.phi"), wb.at("outer.phi")));
    EXPECT_TRUE(torch::equal(wa.at("outer.momentum"), wb.at("outer.momentum")));
  }
}

TEST_F(Distributed, NoLoCoWithEightReplicasSurvivesTwoKilledWorkers) {
  // Two workers die at random steps; the other six must finish and say so.
  std::random_device rd;
  const int a = 1 + int(rd() % 7), b = 1 + (a + int(rd() % 6)) % 7;  // two distinct ranks in 1..7
  const int step_a = 2 + int(rd() % 8), step_b = 2 + int(rd() % 8);
  const std::string plan = fmt::format("{}:{},{}:{}", a, step_a, b, step_b);
  SCOPED_TRACE("inject_crash=" + plan);
  auto r = noloco::testing::run_cli(small_train_args(dir / "c.txt", dir / "crash") +
                                        " method=noloco replicas=8 batch=2 steps=45 outer_interval=3 inject_crash=" + plan,
                                    120);
  EXPECT_EQ(r.exit_code, 3) << "finished, but not whole: " << r.output;
  const auto summary = read_json(dir / "crash/summary.json");
  std::vector<int> expected_finished;
  for (int i = 0; i < 8; ++i)
    if (i != a && i != b) expected_finished.push_back(i);
  EXPECT_EQ(summary["replicas_finished"].get<std::vector<int>>(), expected_finished);
  ASSERT_EQ(summary["replicas_failed"].size(), 2u);
  for (auto& f : summary["replicas_failed"]) {
    EXPECT_TRUE(f.contains("seconds")) << "when it failed";
    EXPECT_NE(f["reason"].get<std::string>().find("was killed by signal 9"), std::string::npos) << f.dump();
  }
  // A dead replica's partner averages without it. Deaths are noticed without
  // any global barrier, so the outer step whose grouping first leaves a dead
  // replica out varies; but every replica draws from the same live members at
  // an outer step, a dead replica once left out stays out, and long after the
  // deaths (the last outer step) it is out.
  std::map<int64_t, std::vector<int>> members;  // outer step -> the live replicas its groups came from
  for (auto& rec : metrics_records(dir / "crash", "outer")) {
    const auto outer = rec["outer_step"].get<int64_t>();
    const auto live = rec["members"].get<std::vector<int>>(), group = rec["group"].get<std::vector<int>>(),
               arrived = rec["arrived"].get<std::vector<int>>();
    if (!members.count(outer)) members[outer] = live;
    EXPECT_EQ(live, members[outer]) << "one outer step, one set of members: " << rec.dump();
    for (int g : group) EXPECT_TRUE(std::count(live.begin(), live.end(), g)) << rec.dump();
    const bool with_dead = std::count(group.begin(), group.end(), a) || std::count(group.begin(), group.end(), b);
    if (!with_dead) EXPECT_EQ(arrived, group) << rec.dump();
  }
  ASSERT_EQ(members.size(), 15u);
  for (int dead : {a, b}) {
    bool left_out = false;
    for (auto& [outer, live] : members) {
      const bool in = std::count(live.begin(), live.end(), dead);
      EXPECT_FALSE(left_out && in) << "dead replica " << dead << " came back into the members at outer step " << outer;
      left_out = left_out || !in;
    }
    EXPECT_TRUE(left_out) << "dead replica " << dead << " never left the members";
  }
  EXPECT_EQ(metrics_records(dir / "crash", "train").size(), 6u * 45u + size_t(step_a + step_b));
}

// Issue 6's rejoin: worker 2 is killed before any checkpoint exists; the
// launcher restarts it, it takes a live replica's state over the network and
// is back in the groupings from a later outer step.
TEST_F(Distributed, ARestartedNoLoCoWorkerRejoinsFromALivePeer) {
  auto r = noloco::testing::run_cli(small_train_args(dir / "c.txt", dir / "rejoin") +
                                        " method=noloco replicas=4 batch=2 steps=300 outer_interval=10 eval_interval=150"
                                        " inject_crash=2:25 restarts=1",
                                    150);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto summary = read_json(dir / "rejoin/summary.json");
  EXPECT_EQ(summary["replicas_finished"].get<std::vector<int>>(), (std::vector<int>{0, 1, 2, 3}));
  EXPECT_TRUE(summary["replicas_failed"].empty());
  ASSERT_EQ(summary["replicas_restarted"].size(), 1u);
  EXPECT_EQ(summary["replicas_restarted"][0]["replica"], 2);
  EXPECT_TRUE(summary.contains("weight_std")) << "the evaluation across replicas includes the rejoined one";

  const auto rejoins = metrics_records(dir / "rejoin", "rejoin");
  ASSERT_EQ(rejoins.size(), 1u);
  const auto step = rejoins[0]["step"].get<int64_t>();
  const int donor = rejoins[0]["donor"].get<int>();
  EXPECT_GT(step, 25) << "the state comes from a live replica, not from a checkpoint before the crash";
  EXPECT_EQ(step % 10, 0) << "handed over after an outer step";
  EXPECT_NE(donor, 2);
  bool donated = false;
  for (auto& d : metrics_records(dir / "rejoin", "donate"))
    donated |= d["replica"] == donor && d["to"] == 2 && d["step"] == step;
  EXPECT_TRUE(donated);
  // The restarted worker trains on from the donor's step, and averages with partners again.
  int64_t first_after = -1;
  bool averaged_with_a_partner = false;
  for (auto& rec : metrics_records(dir / "rejoin", "train"))
    if (rec["replica"] == 2 && rec["step"].get<int64_t>() > 25 && first_after < 0) first_after = rec["step"];
  EXPECT_EQ(first_after, step + 1);
  for (auto& rec : metrics_records(dir / "rejoin", "outer"))
    if (rec["replica"] == 2 && rec["step"].get<int64_t>() > step && rec["arrived"].size() > 1)
      averaged_with_a_partner = true;
  EXPECT_TRUE(averaged_with_a_partner);
}

// Issue 67 item 5: a replica that blows up by itself (its weights thrown off
// by noise of std 1: bad data, a hardware fault) is refused by its partners
// (its increment far larger than those they met), told so, and takes a live
// replica's state; every replica ends where the undisturbed run does (within
// 1.5%: the renewal moved them 0.3%). Before, its partners averaged the noise
// in and the run ended 56% higher. Three messages: θ; Δ with φ, where the
// thrown-off replica's next Δ is small but its φ is not (that case once ended
// 4.8% higher); and top-k, whose messages carry a sliver of the noise and were
// once judged against a replica's whole Δ (on the Vim manual, one replica
// ended 27% higher).
// Undisturbed, θ and Δ with φ train alike (γ = β). A renewal that lands on
// an evaluation step evaluates there with the others (their group could hold
// the renewed replica, and the drills saw them wait peer_timeout for it).
TEST_F(Distributed, ADivergedReplicaIsRefusedAndTakesALiveReplicasState) {
  const std::string common = " method=noloco replicas=4 batch=2 steps=200 outer_interval=10 eval_interval=20";
  struct Case {
    std::string name, keys, control;
  };
  const std::vector<Case> cases = {{"theta", "noloco_message=theta", "control"},
                                   {"delta_phi", "noloco_message=delta_phi", "control"},
                                   {"topk", "compression=topk outer_interval=10", "control_topk"}};
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    const auto control = dir / c.control;
    if (!std::filesystem::exists(control)) {
      run(c.control, common + " " + c.keys);
      EXPECT_FALSE(read_json(control + "/summary.json").contains("replicas_refused_as_diverged"))
          << "no healthy replica is refused";
      double largest_healthy_ratio = 0;
      for (auto& o : metrics_records(control, "outer"))
        largest_healthy_ratio = std::max(largest_healthy_ratio, o.value("largest_increment_ratio", 0.0));
      std::printf("%s: largest ratio of a partner's increment to those a replica met, undisturbed: %.2f\n",
                  c.name.c_str(), largest_healthy_ratio);
      EXPECT_LT(largest_healthy_ratio, 3.0);
    }
    const auto drilled = run("diverged_" + c.name, common + " " + c.keys + " inject_crash=3:45:diverge");
    const auto summary = read_json(drilled + "/summary.json");
    EXPECT_EQ(summary["replicas_finished"].get<std::vector<int>>(), (std::vector<int>{0, 1, 2, 3}));
    EXPECT_EQ(summary.value("replicas_refused_as_diverged", std::vector<int>{}), std::vector<int>{3})
        << summary.dump();
    EXPECT_EQ(summary.value("replicas_renewed", std::vector<int>{}), std::vector<int>{3}) << summary.dump();
    const auto rejoins = metrics_records(drilled, "rejoin");
    ASSERT_EQ(rejoins.size(), 1u);
    EXPECT_EQ(rejoins[0]["replica"], 3);
    EXPECT_GE(rejoins[0]["refused_at_step"].get<int64_t>(), 50);
    EXPECT_GE(rejoins[0]["step"].get<int64_t>(), rejoins[0]["refused_at_step"].get<int64_t>());
    const int64_t renewed_at = rejoins[0]["step"];
    std::printf("%s: refused at step %lld, renewed at step %lld\n", c.name.c_str(),
                (long long)rejoins[0]["refused_at_step"].get<int64_t>(), (long long)renewed_at);
    // On an evaluation step the renewed replica evaluates there too, and no
    // replica waits out peer_timeout (30 s) for it (the spread itself may be
    // skipped: the group may be formed while the renewed replica counts as dead).
    std::map<int, double> evaluation_seconds;
    bool renewed_evaluated = false;
    for (auto& v : metrics_records(drilled, "val")) {
      evaluation_seconds[v["replica"].get<int>()] = v["evaluation_seconds"].get<double>();
      renewed_evaluated |= v["replica"] == 3 && v["step"] == renewed_at;
    }
    if (renewed_at % 20 == 0) EXPECT_TRUE(renewed_evaluated) << "replica 3 evaluated at step " << renewed_at;
    for (const auto& [replica, seconds] : evaluation_seconds)
      EXPECT_LT(seconds, 15.0) << "replica " << replica << " waited in its evaluations";
    for (int r = 0; r < 4; ++r) {
      const auto path = fmt::format("summary_r{}.json", r);
      const double ends = read_json(drilled + "/" + path)["final_val_loss"].get<double>();
      const double undisturbed = read_json(control + "/" + path)["final_val_loss"].get<double>();
      std::printf("%s: replica %d: final val loss %.4f, undisturbed %.4f\n", c.name.c_str(), r, ends, undisturbed);
      EXPECT_NEAR(ends, undisturbed, 0.015 * undisturbed) << "replica " << r;
    }
  }
}

// A frozen worker (SIGSTOP: a hung process or machine) under the local
// launcher: it stops beating, the launcher kills it and the others finish.
TEST_F(Distributed, TheLauncherKillsAWorkerWhoseHeartbeatStops) {
  auto r = noloco::testing::run_cli(small_train_args(dir / "c.txt", dir / "frozen") +
                                        " method=noloco replicas=3 batch=2 steps=60 outer_interval=10"
                                        " heartbeat_timeout=4 peer_timeout=600 inject_crash=1:15:freeze",
                                    100);
  ASSERT_EQ(r.exit_code, 3) << r.output;
  const auto summary = read_json(dir / "frozen/summary.json");
  EXPECT_EQ(summary["replicas_finished"].get<std::vector<int>>(), (std::vector<int>{0, 2}));
  ASSERT_EQ(summary["replicas_failed"].size(), 1u);
  EXPECT_NE(summary["replicas_failed"][0]["reason"].get<std::string>().find("no heartbeat"), std::string::npos);
}

// Issue 84: the README's torchrun line, on one node with the torchrun the
// setup installs, trains a run to its end.
TEST_F(Distributed, TheReadmesTorchrunLineTrainsARun) {
  const auto torchrun = (std::filesystem::path(NOLOCO_TORCH_PYTHON).parent_path() / "torchrun").string();
  const std::string out = dir / "under_torchrun";
  const auto r = noloco::testing::run_command(
      fmt::format("{} --nnodes=1 --nproc_per_node=2 --rdzv-backend=static --master-addr=127.0.0.1 --master-port={} "
                  "--node-rank=0 --no-python {} {} method=noloco batch=2 steps=12 outer_interval=3 bind=127.0.0.1",
                  torchrun, noloco::testing::free_port(), NOLOCO_BINARY, small_train_args(dir / "c.txt", out)),
      120, "NOLOCO_RUN_TOKEN=torchrun-readme-test");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto summary = read_json(out + "/summary.json");
  EXPECT_EQ(summary["replicas_finished"].get<std::vector<int>>(), (std::vector<int>{0, 1})) << summary.dump();
  EXPECT_EQ(metrics_records(out, "outer").size(), 8u) << "4 outer steps for each of the 2 replicas";
}

// Issue 84: on a run of several machines every worker but worker 0 printed
// nothing. Each machine's first worker prints its progress, with its last
// outer step's partner and route.
TEST_F(Distributed, AWorkerOnAMachineOfItsOwnPrintsItsProgress) {
  const std::string env = fmt::format("WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT={} NOLOCO_RUN_TOKEN=progress-test",
                                      noloco::testing::free_port());
  const std::string args = small_train_args(dir / "c.txt", dir / "two_machines") +
                           " method=noloco batch=2 steps=12 outer_interval=3 log_interval=4";
  const std::string second = dir / "second.log";
  const std::string script = dir / "two_machines.sh";
  noloco::testing::write_text(script, "RANK=1 " + env + " timeout -k 5 90 " NOLOCO_BINARY " " + args + " > " + second +
                                           " 2>&1 &\nother=$!\nRANK=0 " + env + " timeout -k 5 90 " NOLOCO_BINARY " " +
                                           args + "\nrc=$?\nwait $other\nexit $(( rc | $? ))\n");
  const auto r = noloco::testing::run_command("bash " + script, 120);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto printed = noloco::testing::read_text(second);
  EXPECT_NE(printed.find("step     12/12"), std::string::npos) << printed;
  EXPECT_NE(printed.find("last outer step with 0 (direct)"), std::string::npos) << printed;
}

// Issue 83: a worker refused at start was left for its heartbeat to go
// silent: its partner waited heartbeat_timeout at its first exchange and the
// summary said "no heartbeat". It marks itself out, with the reason, and
// the partner's wait ends there.
TEST_F(Distributed, AWorkerRefusedAtStartIsOutAtOnceAndTheSummarySaysWhy) {
  const std::string env = fmt::format("WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT={} NOLOCO_RUN_TOKEN=refused-test",
                                      noloco::testing::free_port());
  const std::string out = dir / "refused";
  // With heartbeat_timeout=120 a wait for its heartbeat would outlast the 60-s bound.
  const std::string args = small_train_args(dir / "c.txt", out) +
                           " method=noloco batch=2 steps=12 outer_interval=3 heartbeat_timeout=120";
  const std::string script = dir / "refused.sh", refused_log = dir / "refused.log";
  noloco::testing::write_text(script, "RANK=1 " + env + " timeout -k 5 60 " NOLOCO_BINARY " " + args + " lr=0.5 > " +
                                           refused_log + " 2>&1 &\nRANK=0 " + env + " timeout -k 5 60 " NOLOCO_BINARY " " +
                                           args + "\nrc=$?\nwait\nexit $rc\n");
  const auto r = noloco::testing::run_command("bash " + script, 90);
  EXPECT_NE(r.exit_code, 124) << r.output;
  EXPECT_NE(noloco::testing::read_text(refused_log).find("another config than the run's"), std::string::npos)
      << noloco::testing::read_text(refused_log);
  const auto summary = read_json(out + "/summary.json");
  EXPECT_EQ(summary["replicas_finished"].get<std::vector<int>>(), std::vector<int>{0}) << summary.dump();
  ASSERT_EQ(summary["replicas_failed"].size(), 1u) << summary.dump();
  const auto reason = summary["replicas_failed"][0]["reason"].get<std::string>();
  EXPECT_NE(reason.find("refused at start"), std::string::npos) << reason;
  EXPECT_NE(reason.find("lr"), std::string::npos) << reason;
  // A grouping drawn before its refusal reached the store may still name it;
  // none after, and it never arrives at an exchange.
  const auto outer = metrics_records(out, "outer");
  ASSERT_FALSE(outer.empty());
  bool left_out = false;
  for (const auto& rec : outer) {
    EXPECT_EQ(rec["arrived"], std::vector<int>{0}) << rec.dump();
    const bool alone = rec["group"] == std::vector<int>{0};
    EXPECT_FALSE(left_out && !alone) << "grouped again after it was left out: " << rec.dump();
    left_out |= alone;
  }
  EXPECT_TRUE(left_out) << outer.back().dump();
}

// Without our launcher (as under torchrun, which knows nothing of our
// heartbeats) the partner itself gives up a frozen worker: with
// peer_timeout=600 only the heartbeat can end its wait within the test's bound.
TEST_F(Distributed, APartnerGivesUpAFrozenWorkerByItsHeartbeat) {
  const std::string env = fmt::format(
      "WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT={} NOLOCO_RUN_TOKEN=frozen-partner-test", noloco::testing::free_port());
  const std::string args = small_train_args(dir / "c.txt", dir / "torchrun_like") +
                           " method=noloco batch=2 steps=40 outer_interval=10 heartbeat_timeout=4 peer_timeout=600"
                           " inject_crash=1:15:freeze";
  // Worker 1 runs in the background and freezes; worker 0 (hosting the store) must finish alone.
  const std::string cmd = "cd " NOLOCO_SOURCE_DIR " && { RANK=1 " + env + " " NOLOCO_BINARY " " + args +
                          " > /dev/null 2>&1 & frozen=$!; }; RANK=0 " + env + " timeout -k 5 90 " NOLOCO_BINARY " " +
                          args + " 2>&1; rc=$?; kill -9 $frozen; exit $rc";
  FILE* p = ::popen(cmd.c_str(), "r");
  ASSERT_NE(p, nullptr);
  std::string output;
  char buf[4096];
  for (size_t n; (n = std::fread(buf, 1, sizeof buf, p)) > 0;) output.append(buf, n);
  const int status = ::pclose(p);
  ASSERT_TRUE(WIFEXITED(status));
  ASSERT_EQ(WEXITSTATUS(status), 0) << output;
  bool alone_after_freeze = false;
  for (auto& rec : metrics_records(dir / "torchrun_like", "outer"))
    if (rec["replica"] == 0 && rec["step"].get<int64_t>() > 15)
      alone_after_freeze |= rec["arrived"] == std::vector<int>{0};
  EXPECT_TRUE(alone_after_freeze);
  // With no launcher to write it, worker 0 writes the run's summary (issue 66), the frozen one given up.
  const auto summary = read_json(dir / "torchrun_like/summary.json");
  EXPECT_EQ(summary["replicas_finished"].get<std::vector<int>>(), std::vector<int>{0}) << summary.dump();
  ASSERT_EQ(summary["replicas_failed"].size(), 1u) << summary.dump();
  EXPECT_EQ(summary["replicas_failed"][0]["replica"], 1) << summary.dump();
  EXPECT_NE(summary["replicas_failed"][0]["reason"].get<std::string>().find("no heartbeat"), std::string::npos);
}

// Issue 33 (split groups): a replica that falls behind while alive (a long
// hand-over, a pause) was given up at peer_timeout by every partner it met
// afterwards, for it was still behind: it trained alone, or failed its
// partners, for much of the run. A partner now waits for a replica that is
// behind but moving (its progress counter advances), so the lag is absorbed
// once. Replica 1 stalls 6 s (three times peer_timeout) after step 30: the
// exchanges of steps 40 and 50 lose it; it catches up alone through the ones
// it was left out of, and from then on no exchange fails.
// pace=speed: a replica whose steps take four times as long (slowdown=3:4)
// trains in about a quarter of the slots once it has heard of the others'
// pace, its partners weigh its increments by those steps, and its pace
// survives a resume (a checkpoint holds what it trained).
TEST_F(Distributed, APacedReplicaFourTimesSlowerTrainsAboutAQuarterOfTheSlotsAndSaysSo) {
  const std::string common = "method=noloco replicas=4 outer_interval=10 decay_steps=120 pace=speed slowdown=3:4 "
                             "checkpoint_interval=60";
  run("paced", common + " steps=60");
  const auto paced = run("paced", common + " steps=120 resume=true");
  bool weighed = false;
  for (auto& rec : metrics_records(paced, "outer")) {
    ASSERT_TRUE(rec.contains("trained_steps")) << rec.dump();
    const int replica = rec["replica"].get<int>(), outer_step = rec["outer_step"].get<int>();
    if (replica == 3 && outer_step >= 3) EXPECT_LE(rec["trained_steps"].get<int>(), 5) << rec.dump();
    if (rec.contains("partners_trained_steps") && rec["partners_trained_steps"].contains("3"))
      weighed |= rec["partners_trained_steps"]["3"].get<int>() <= 5;
  }
  EXPECT_TRUE(weighed) << "a partner of replica 3 took its increment with its few steps";
  const auto slow = read_json(paced + "/summary_r3.json"), fast = read_json(paced + "/summary_r0.json");
  EXPECT_LT(slow["tokens"].get<double>(), 0.6 * fast["tokens"].get<double>());
  EXPECT_LT(slow["trained_steps_per_outer_step"].get<double>(), 6.0);
  const auto summary = read_json(paced + "/summary.json");
  EXPECT_EQ(summary["steps_per_second_replicas"].size(), 4u);
  EXPECT_EQ(summary["final_val_loss_replicas"].size(), 4u);
}

// Issue 105: a paced run stopped anywhere and resumed from an earlier
// checkpoint comes back to where it stopped bit for bit: each replica trains
// the slots its record holds after the checkpoint, not those its step times,
// measured anew, would choose. Here the run's last checkpoints are lost and
// it resumes from step 30 of 60; replica 1, four times slower, left slots out
// after step 30, and is only twice as slow when resumed.
TEST_F(Distributed, APacedRunResumedFromAnEarlierCheckpointReplaysItsSlotsBitIdentically) {
  const std::string common = "method=noloco replicas=2 steps=60 outer_interval=10 decay_steps=60 pace=speed "
                             "checkpoint_interval=30";
  const auto paced = run("paced", common + " slowdown=1:4");
  const auto slots = noloco::testing::read_text(paced + "/checkpoints/r1/pace_slots");
  ASSERT_EQ(slots.size(), 60u) << slots;
  ASSERT_NE(slots.find('0', 30), std::string::npos) << "replica 1 left slots out after step 30: " << slots;
  std::map<int, TensorMap> first;  // each replica's state at step 60, before the resume
  for (int r = 0; r < 2; ++r) {
    const auto step_60 = fmt::format("{}/checkpoints/r{}/step_{:08d}", paced, r, 60);
    first[r] = load_tensors(step_60 + "/state.safetensors");
    std::filesystem::remove_all(step_60);
  }
  run("paced", common + " slowdown=1:2 resume=true");
  EXPECT_EQ(noloco::testing::read_text(paced + "/checkpoints/r1/pace_slots"), slots);
  for (int r = 0; r < 2; ++r) {
    const auto again = load_tensors(find_checkpoint(fmt::format("{}/checkpoints/r{}", paced, r)) + "/state.safetensors");
    ASSERT_EQ(again.size(), first[r].size());
    for (const auto& [name, t] : first[r]) {
      // The step times it measured, and the share it would take from them, are the run's own.
      if (name == "pace.state" || name == "pace.heard") continue;
      EXPECT_TRUE(torch::equal(t, again.at(name))) << "replica " << r << ": " << name;
    }
  }
}

// Issue 105: a partner alive but late past partner_wait is left behind, not
// lost: the fast replica steps without it, never declaring it dead (it stays
// in every later snapshot), and the slow one, coming late, steps alone, told
// so; its work stays in its weights for its next meeting. In the first period
// nobody's pace is known, so replica 1 (8 times slower) trains every slot and
// comes late; from its partner's note it learns its pace all the same.
TEST_F(Distributed, APartnerLatePastThePartnerWaitIsLeftBehindNotLost) {
  const auto waited = run("partner_wait", "method=noloco replicas=2 steps=80 outer_interval=10 pace=speed "
                                          "slowdown=1:8 partner_wait=0.1");
  int left = 0, was_left = 0;
  int64_t slow_last_period = -1;
  for (auto& rec : metrics_records(waited, "outer")) {
    const int replica = rec["replica"].get<int>();
    if (rec.contains("left_behind")) {
      EXPECT_EQ(replica, 0) << rec.dump();
      EXPECT_EQ(rec["left_behind"], nlohmann::json({1})) << rec.dump();
      EXPECT_EQ(rec["arrived"], nlohmann::json({0})) << rec.dump();
      ++left;
    }
    if (rec.value("was_left_behind", false)) {
      EXPECT_EQ(replica, 1) << rec.dump();
      EXPECT_EQ(rec["arrived"], nlohmann::json({1})) << rec.dump();
      ++was_left;
    }
    if (replica == 0) EXPECT_EQ(rec["members"], nlohmann::json({0, 1})) << "replica 1 was held lost: " << rec.dump();
    if (replica == 1) slow_last_period = rec["trained_steps"].get<int64_t>();
  }
  EXPECT_GT(left, 0) << "the slow replica was never left behind: the test checks nothing";
  EXPECT_GT(was_left, 0);
  EXPECT_LE(slow_last_period, 5) << "replica 1 did not learn its pace";
  EXPECT_EQ(read_json(waited + "/summary.json")["final_val_loss_replicas"].size(), 2u);
}

TEST_F(Distributed, AReplicaThatFellBehindIsWaitedForAndPairsAgain) {
  // Steps long enough (batch 64) that catching up alone, without the
  // exchanges' cost, does not by itself close the gap before the first
  // pairing; and enough of them that the others are still training when it
  // wakes (at 200 steps they had finished on this Intel machine, 6 s after it
  // went to sleep).
  const auto behind = run("behind", "method=noloco replicas=4 batch=64 steps=400 outer_interval=10 peer_timeout=2"
                                    " inject_crash=1:30:stall=6");
  std::map<int, int> records;
  bool lost_one = false, paired_again = false;
  for (auto& rec : metrics_records(behind, "outer")) {
    const int replica = rec["replica"].get<int>(), outer_step = rec["outer_step"].get<int>();
    ++records[replica];
    if (outer_step <= 4) {
      lost_one |= rec["arrived"].size() < rec["group"].size();
      continue;
    }
    EXPECT_EQ(rec["arrived"], rec["group"]) << "replica " << replica << " outer step " << outer_step;
    paired_again |= replica == 1 && rec["group"].size() == 2;
  }
  EXPECT_EQ(records, (std::map<int, int>{{0, 40}, {1, 40}, {2, 40}, {3, 40}}));
  EXPECT_TRUE(lost_one);  // the stall did cost an exchange: the drill bit
  EXPECT_TRUE(paired_again);
}

TEST_F(Distributed, DdpEndsWithAClearErrorWhenAWorkerDies) {
  auto r = noloco::testing::run_cli(
      small_train_args(dir / "c.txt", dir / "ddpcrash") + " method=ddp replicas=3 batch=2 steps=50 inject_crash=1:4", 90);
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.exit_code, 124) << "timed out instead of failing: " << r.output;
  EXPECT_NE(r.output.find("worker 1 was killed by signal 9"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("noloco: error: ddp run failed: worker 1 was killed"), std::string::npos) << r.output;
}

TEST(MessageHeader, RejectsOtherRunsKindsExchangesSizesAndFormats) {
  MessageHeader ok;
  ok.run = 42;
  ok.kind = int64_t(MessageKind::exchange);
  ok.exchange = 7;
  ok.bytes = 1000;
  ok.format = 6;
  EXPECT_EQ(check_message_header(ok, ok), "");
  auto with = [&](auto change) {
    MessageHeader h = ok;
    change(h);
    return check_message_header(ok, h);
  };
  EXPECT_EQ(with([](MessageHeader& h) { h.magic = 2; }), "not a noloco message");
  EXPECT_NE(with([](MessageHeader& h) { h.run = 43; }).find("another run"), std::string::npos);
  EXPECT_NE(with([](MessageHeader& h) { h.kind = int64_t(MessageKind::state); }).find("got training state"),
            std::string::npos);
  EXPECT_NE(with([](MessageHeader& h) { h.exchange = 8; }).find("exchange 8"), std::string::npos);
  EXPECT_NE(with([](MessageHeader& h) { h.bytes = 999; }).find("999 payload bytes"), std::string::npos);
  EXPECT_NE(with([](MessageHeader& h) { h.format = 15; }).find("payload format 15"), std::string::npos);
  EXPECT_NE(with([](MessageHeader& h) { h.origin = 3; }).find("data of replica 3"), std::string::npos);
  // Round trip through the words on the wire.
  const auto w = ok.words();
  EXPECT_EQ(check_message_header(ok, MessageHeader::from_words(w.data())), "");
}

TEST_F(Distributed, AWorkerWithTheWrongTokenCannotJoin) {
  const std::string run_dir = dir / "guarded";
  noloco::testing::BackgroundCli runner(small_train_args(dir / "c.txt", run_dir) +
                                            " method=noloco replicas=2 batch=2 steps=100000 outer_interval=10",
                                        90);
  // Once the run is training (its workers have joined), try to join its store with another token.
  const bool training = noloco::testing::wait_for_record(run_dir, "train", 60);
  const pid_t worker = noloco::testing::worker_of(run_dir, 0);
  const std::string store = worker > 0 ? noloco::testing::environment_of(worker, "NOLOCO_STORE") : "";
  const auto stray = noloco::testing::run_cli(
      "train configs/shakespeare.yaml data=" + dir / "c.txt" + " out=" + dir / "stray" +
          " method=noloco replicas=2 peer_timeout=3 hidden=32 layers=2 heads=2 intermediate=64 context=32",
      30, "RANK=1 WORLD_SIZE=2 TORCHELASTIC_USE_AGENT_STORE=True NOLOCO_STORE=" + store + " NOLOCO_RUN_TOKEN=not-the-token");
  // Ctrl-C to the launcher ends the run: it forwards the signal to its workers.
  EXPECT_EQ(::system(("pkill -INT -f '[n]oloco train .*out=" + run_dir + " '").c_str()), 0);
  const auto& main_run = runner.wait();
  ASSERT_TRUE(training) << main_run.output;
  ASSERT_EQ(store.rfind("unix://", 0), 0u) << "the launcher's store is a private unix socket: " << store;
  EXPECT_NE(stray.exit_code, 0) << stray.output;
  EXPECT_NE(stray.exit_code, 124) << "the stray worker hung: " << stray.output;
  EXPECT_NE(stray.output.find("could not join the run"), std::string::npos) << stray.output;
  EXPECT_NE(main_run.output.find("forwarding signal 2 to the workers"), std::string::npos) << main_run.output;
  EXPECT_EQ(main_run.output.find("rejected"), std::string::npos) << main_run.output;
}

// Issue 12: a worker killed while starting (before it joins) used to hold the
// others at the rendezvous until it timed out. NoLoCo needs no run-wide group.
TEST_F(Distributed, AWorkerKilledWhileStartingDoesNotStopNoLoCo) {
  auto r = noloco::testing::run_cli(small_train_args(dir / "c.txt", dir / "startup") +
                                        " method=noloco replicas=4 batch=2 steps=30 outer_interval=5"
                                        " peer_timeout=60 inject_crash=2:startup",
                                    50);  // well under the 60 s a rendezvous would wait
  ASSERT_EQ(r.exit_code, 3) << r.output;
  const auto summary = read_json(dir / "startup/summary.json");
  EXPECT_EQ(summary["replicas_finished"].get<std::vector<int>>(), (std::vector<int>{0, 1, 3}));
}

TEST_F(Distributed, TheLauncherRefusesMoreWorkersThanTheMachineHosts) {
  const auto t0 = std::chrono::steady_clock::now();
  auto r = noloco::testing::run_cli(small_train_args(dir / "c.txt", dir / "many") + " method=noloco replicas=100000", 30);
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("100000 workers on this machine"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("max_local_workers"), std::string::npos) << r.output;
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(20)) << "refused before starting anything";
  r = noloco::testing::run_cli(small_train_args(dir / "c.txt", dir / "capped") +
                                   " method=noloco replicas=3 max_local_workers=2", 30);
  EXPECT_NE(r.output.find("more than max_local_workers=2"), std::string::npos) << r.output;
}


TEST_F(Distributed, ASignalWhileStartingStopsTheLauncherAndEveryWorker) {
  const std::string run = dir / "interrupted";
  noloco::testing::BackgroundCli launcher(small_train_args(dir / "c.txt", run) + " method=noloco replicas=8 steps=100000", 60);
  // While it starts its store and workers (it has taken the run directory), to the launcher alone.
  pid_t pid = -1;
  for (int i = 0; i < 1000 && ((pid = noloco::testing::launcher_of(run)) < 0 || !std::filesystem::exists(run + "/run.lock")); ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  ASSERT_GT(pid, 0);
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  EXPECT_EQ(::kill(pid, SIGINT), 0);
  const auto& result = launcher.wait();
  EXPECT_EQ(result.exit_code, 128 + 2) << result.output;  // not 124: the 60 s bound was not reached
  EXPECT_NE(result.output.find("interrupted by signal 2"), std::string::npos) << result.output;
  EXPECT_NE(::system(("pgrep -f '[n]oloco train .*out=" + run + "' > /dev/null").c_str()), 0) << "a worker outlived it";
}


// Issue 32's drill: worker 1 is killed and rejoins; then the replica that
// handed it its state is killed. The rejoin emptied the store's list of dead
// workers, and declaring the second death spun the launcher on the store for
// ever; and the donor, restarted, took worker 1's old request for one of its
// own and waited a minute to serve it. The run must end by itself, with a
// summary naming both failures, no such wait and no process left.
TEST_F(Distributed, ASecondFailureAfterARejoinEndsTheRun) {
  const std::string run = dir / "twice";
  noloco::testing::BackgroundCli launcher(small_train_args(dir / "c.txt", run) +
                                          " method=noloco replicas=4 batch=2 steps=2000 outer_interval=10"
                                          " eval_interval=1000 log_interval=100 restarts=1 inject_crash=1:25",
                                      240);
  // The event the drill is about: worker 1 back, from a live peer's state.
  const bool rejoined = noloco::testing::wait_for_record(run, "rejoin", 180);
  int donor = -1;
  pid_t second = -1;
  if (rejoined) {
    donor = metrics_records(run, "rejoin").at(0)["donor"].get<int>();
    for (int i = 0; i < 100 && (second = noloco::testing::worker_of(run, donor)) < 0; ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  if (second > 0) ::kill(second, SIGKILL);
  const auto& result = launcher.wait();
  ASSERT_TRUE(rejoined) << result.output;
  ASSERT_GT(second, 0) << "the donor, worker " << donor << ", was not found to kill";
  EXPECT_EQ(result.output.find("could not hand over state"), std::string::npos) << result.output;
  // 0 when worker 2 rejoined too (restarts=1 each), 3 when the run ended before it could.
  EXPECT_TRUE(result.exit_code == 0 || result.exit_code == 3) << result.exit_code << "\n" << result.output;
  const auto summary = read_json(run + "/summary.json");
  std::set<int> failed;
  for (const auto& f : summary["replicas_restarted"]) failed.insert(f["replica"].get<int>());
  for (const auto& f : summary["replicas_failed"]) failed.insert(f["replica"].get<int>());
  EXPECT_EQ(failed, (std::set<int>{1, donor})) << summary.dump();
  EXPECT_NE(::system(("pgrep -f '[n]oloco train .*out=" + run + "' > /dev/null").c_str()), 0) << "a worker outlived it";
}

// A launcher whose store stops answering (etcd frozen) still stops on
// SIGTERM, with every worker, within the bound of one store call.
TEST_F(Distributed, TheLauncherAnswersSIGTERMWhileItsStoreIsFrozen) {
  const std::string run = dir / "frozen_store";
  noloco::testing::BackgroundCli launcher(small_train_args(dir / "c.txt", run) +
                                          " method=noloco replicas=2 batch=2 steps=1000000 outer_interval=10",
                                      120);
  const bool training = noloco::testing::wait_for_record(run, "train", 60);
  const pid_t pid = noloco::testing::launcher_of(run);
  const pid_t etcd = pid > 0 ? noloco::testing::child_of(pid, EtcdServer::binary()) : -1;
  if (etcd > 0) ::kill(etcd, SIGSTOP);
  std::this_thread::sleep_for(std::chrono::milliseconds(1500));  // the launcher's heartbeat reads now block
  const auto t0 = std::chrono::steady_clock::now();
  if (pid > 0) ::kill(pid, SIGTERM);
  const auto& result = launcher.wait();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (etcd > 0) ::kill(etcd, SIGKILL);  // gone with its launcher already, unless the test failed
  ASSERT_TRUE(training) << result.output;
  ASSERT_GT(etcd, 0) << "the run's etcd was not found";
  EXPECT_EQ(result.exit_code, 128 + SIGTERM) << result.output;
  EXPECT_LT(seconds, 40) << "stopped only after " << seconds << " s";
  EXPECT_NE(::system(("pgrep -f '[n]oloco train .*out=" + run + "' > /dev/null").c_str()), 0) << "a worker outlived it";
}

// Issue 83 item 1: a launcher whose private etcd died ended the run within
// 0.4 s (and a worker aborted in 2 of 10 tries). It starts the store again
// on its data; the workers train through the outage and finish, pairing
// again after it.
TEST_F(Distributed, ALauncherWhoseStoreDiedStartsItAgainAndTheRunFinishes) {
  const std::string run = dir / "store_died";
  const int steps = 3000;
  noloco::testing::BackgroundCli launcher(small_train_args(dir / "c.txt", run) +
                                              fmt::format(" method=noloco replicas=2 batch=2 steps={} outer_interval=20"
                                                          " log_interval=100",
                                                          steps),
                                          180);
  const bool exchanged = noloco::testing::wait_for_record(run, "outer", 90);
  const pid_t pid = noloco::testing::launcher_of(run);
  const pid_t etcd = pid > 0 ? noloco::testing::child_of(pid, EtcdServer::binary()) : -1;
  if (etcd > 0) ::kill(etcd, SIGKILL);
  int64_t step_at_kill = 0;
  for (const auto& r : metrics_records(run, "train")) step_at_kill = std::max(step_at_kill, r["step"].get<int64_t>());
  const auto& result = launcher.wait();
  ASSERT_TRUE(exchanged) << result.output;
  ASSERT_GT(etcd, 0) << "the run's etcd was not found";
  EXPECT_LT(step_at_kill, steps / 2) << "the store died too late to matter";
  EXPECT_EQ(result.exit_code, 0) << result.output;
  EXPECT_NE(result.output.find("the run's store (etcd) killed by signal 9: starting it again on its data"),
            std::string::npos)
      << result.output;
  EXPECT_NE(result.output.find("the run's store is back"), std::string::npos) << result.output;
  int paired_after_kill = 0;
  for (const auto& r : metrics_records(run, "outer"))
    if (r["step"].get<int64_t>() > step_at_kill + 200 && r["arrived"].size() == 2) ++paired_after_kill;
  EXPECT_GT(paired_after_kill, 0) << "no exchange after the store came back";
  const auto summary = read_json(run + "/summary.json");
  EXPECT_EQ(summary["replicas_finished"].get<std::vector<int>>(), (std::vector<int>{0, 1})) << summary.dump();
}

// Issue 32: replica 0's newest checkpoint is incomplete (checksums.json lost
// in a crash), the others' complete. All four resume at the newest step every
// replica holds, instead of replica 0 alone at an older one; with no common
// step the resume is refused in one line naming the workers.
TEST_F(Distributed, ReplicasResumeAtTheNewestStepTheyAllHold) {
  const std::string common = "method=noloco replicas=4 batch=2 outer_interval=3 checkpoint_interval=3";
  const auto split = run("split", common + " steps=6");
  const auto step6 = find_checkpoint(split + "/checkpoints/r0");
  ASSERT_NE(step6.find("step_00000006"), std::string::npos) << step6;
  std::filesystem::remove(step6 + "/checksums.json");
  auto r = noloco::testing::run_cli(small_train_args(dir / "c.txt", split) + " " + common + " steps=9 resume=true", 120);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  // Every replica went back to step 3: steps 4 to 6 were trained twice, once in each life.
  std::map<int, int> step4;
  for (auto& rec : metrics_records(split, "train"))
    if (rec["step"].get<int64_t>() == 4) ++step4[rec["replica"].get<int>()];
  EXPECT_EQ(step4, (std::map<int, int>{{0, 2}, {1, 2}, {2, 2}, {3, 2}}));
  // Every replica's newest checkpoint is now step 9, reached from step 3: each trained 6 steps in this life.
  for (int k = 0; k < 4; ++k) {
    const auto sub = split + "/checkpoints/r" + std::to_string(k);
    EXPECT_NE(find_checkpoint(sub).find("step_00000009"), std::string::npos) << k;
    if (k > 0) EXPECT_TRUE(std::filesystem::exists(sub + "/step_00000006.superseded")) << "kept, not deleted: " << k;
  }
  // No common step: replica 0 holds only step 3 complete, replica 1 only steps 6 and 9.
  for (const char* step : {"6", "9"})
    std::filesystem::remove(split + "/checkpoints/r0/step_0000000" + step + "/checksums.json");
  std::filesystem::remove(split + "/checkpoints/r1/step_00000003/checksums.json");
  const auto summary_before = noloco::testing::read_text(split + "/summary.json");
  r = noloco::testing::run_cli(small_train_args(dir / "c.txt", split) + " " + common + " steps=12 resume=true", 120);
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("hold no complete checkpoint of one common step"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("worker 0: newest step 3, worker 1: newest step 9"), std::string::npos) << r.output;
  EXPECT_EQ(noloco::testing::read_text(split + "/summary.json"), summary_before) << "a refused resume keeps the summary";
}

// Issue 33: a worker frozen before its first heartbeat was never killed (it
// was "starting up" for ever) and the launcher waited for it after the others
// finished. Supervision starts with the process: silent past the start-up
// allowance (startup_timeout, 30 s, or heartbeat_timeout if longer), it is killed as hung.
TEST_F(Distributed, AWorkerFrozenBeforeItsFirstHeartbeatIsKilled) {
  auto r = noloco::testing::run_cli(small_train_args(dir / "c.txt", dir / "frozen_start") +
                                        " method=noloco replicas=3 batch=2 steps=60 outer_interval=10"
                                        " heartbeat_timeout=4 startup_timeout=12 peer_timeout=10"
                                        " inject_crash=1:startup:freeze",
                                    120);
  ASSERT_EQ(r.exit_code, 3) << r.output;
  const auto summary = read_json(dir / "frozen_start/summary.json");
  EXPECT_EQ(summary["replicas_finished"].get<std::vector<int>>(), (std::vector<int>{0, 2}));
  ASSERT_EQ(summary["replicas_failed"].size(), 1u);
  EXPECT_NE(summary["replicas_failed"][0]["reason"].get<std::string>().find("no heartbeat"), std::string::npos);
}

// Issue 33: resume=true with fewer steps than a finished run holds used to
// fail in every worker after rewriting config.yaml and summary.json. It is
// refused before anything in the run directory changes.
TEST_F(Distributed, ARefusedResumeRewritesNothing) {
  const auto done = run("done", "method=noloco replicas=2 batch=2 steps=12 outer_interval=3 checkpoint_interval=6");
  const auto config = noloco::testing::read_text(done + "/config.yaml");
  const auto summary = noloco::testing::read_text(done + "/summary.json");
  auto r = noloco::testing::run_cli(small_train_args(dir / "c.txt", done) +
                                        " method=noloco replicas=2 batch=2 steps=6 outer_interval=3 resume=true",
                                    60);
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("holds a checkpoint of step 12, past steps=6"), std::string::npos) << r.output;
  EXPECT_EQ(std::count(r.output.begin(), r.output.end(), '\n'), 1) << "one line: " << r.output;
  EXPECT_EQ(noloco::testing::read_text(done + "/config.yaml"), config);
  EXPECT_EQ(noloco::testing::read_text(done + "/summary.json"), summary);
}

// Issue 33: a replica killed while writing its first checkpoint (or out of
// disk then) holds only step_N.tmp while the others went on; a resume was
// refused until a person deleted the run's checkpoints. The others resume at
// their newest common step and it takes a live replica's state, as a
// restarted worker does.
TEST_F(Distributed, AResumeStartsAWorkerWithoutCheckpointsFromALiveReplica) {
  const std::string common = small_train_args(dir / "c.txt", dir / "first_lost") +
                             " method=noloco replicas=2 batch=2 outer_interval=3 checkpoint_interval=6";
  const auto crashed = noloco::testing::run_cli(common + " steps=12 inject_crash=0:6:checkpoint", 120);
  ASSERT_EQ(crashed.exit_code, 3) << crashed.output;
  ASSERT_TRUE(std::filesystem::exists(dir / "first_lost/checkpoints/r0/step_00000006.tmp"));
  ASSERT_TRUE(std::filesystem::exists(dir / "first_lost/checkpoints/r1/step_00000012/checksums.json"));
  // Worker 1 pauses after its first resumed step, so it cannot finish the run
  // before worker 0 has started and asked for its state.
  const auto resumed = noloco::testing::run_cli(common + " steps=24 resume=true inject_crash=1:13:stall=4", 120);
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_NE(resumed.output.find("worker 0 holds no checkpoint to resume from"), std::string::npos) << resumed.output;
  const auto summary = read_json(dir / "first_lost/summary.json");
  EXPECT_EQ(summary["replicas_finished"].get<std::vector<int>>(), (std::vector<int>{0, 1}));
  // Worker 1 went on from step 12; worker 0 took its state after an outer step past it.
  std::vector<nlohmann::json> taken;
  for (const auto& r : metrics_records(dir / "first_lost", "rejoin"))
    if (r["replica"] == 0) taken.push_back(r);
  ASSERT_EQ(taken.size(), 1u);
  EXPECT_EQ(taken[0]["donor"], 1);
  EXPECT_GT(taken[0]["step"].get<int64_t>(), 12);
  EXPECT_LT(taken[0]["step"].get<int64_t>(), 24);
  EXPECT_TRUE(std::filesystem::exists(dir / "first_lost/checkpoints/r0/step_00000024/checksums.json"));
}

// Issue 29: no single machine holds the run. Its store is a 3-member etcd
// cluster (NOLOCO_STORE lists the members); the member every worker talks to
// is killed while they train, and the run finishes as if nothing happened.
// The two workers share no disk: worker 0 writes the run's summary.json
// with worker 1's summary taken from the store (issue 66).
TEST_F(Distributed, NoLoCoGoesOnWhenAMemberOfItsEtcdClusterDies) {
  if (EtcdServer::binary().empty()) GTEST_SKIP() << "skipped: no etcd binary (install etcd-server)";
  const std::string token = "cluster-run-token";
  noloco::testing::EtcdCluster cluster(3, store_password(token));
  const std::string run_dir = dir / "cluster", other_disk = dir / "cluster_second";
  const int steps = 300;
  const std::string run = fmt::format(" method=noloco replicas=2 batch=2 steps={} outer_interval=10", steps);
  const std::string env = fmt::format("WORLD_SIZE=2 LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT={} "
                                      "NOLOCO_STORE={} NOLOCO_RUN_TOKEN={}",
                                      noloco::testing::free_port(), cluster.endpoints(), token);
  noloco::testing::BackgroundCli second(small_train_args(dir / "c.txt", other_disk) + run, run_timeout_s,
                                        "RANK=1 " + env);
  noloco::testing::BackgroundCli first(small_train_args(dir / "c.txt", run_dir) + run, run_timeout_s, "RANK=0 " + env);
  ASSERT_TRUE(noloco::testing::wait_for_record(run_dir, "outer", 90));
  cluster.kill(0);
  int64_t step_at_kill = 0;
  for (auto& r : metrics_records(run_dir, "train")) step_at_kill = std::max(step_at_kill, r["step"].get<int64_t>());
  const auto& a = first.wait();
  const auto& b = second.wait();
  ASSERT_EQ(a.exit_code, 0) << a.output;
  ASSERT_EQ(b.exit_code, 0) << b.output;
  EXPECT_LT(step_at_kill, steps - 50) << "the member died too late to matter";
  int outer = 0;
  for (auto& r : metrics_records(run_dir, "outer"))
    if (r["replica"] == 0 && r["arrived"].size() == 2) ++outer;
  EXPECT_EQ(outer, steps / 10) << "every outer step had both replicas, before the death and after (killed at step "
                               << step_at_kill << "):\n"
                               << a.output << b.output;
  const auto summary = read_json(run_dir + "/summary.json");
  EXPECT_EQ(summary["replicas_finished"].get<std::vector<int>>(), (std::vector<int>{0, 1})) << summary.dump();
  EXPECT_EQ(read_json(run_dir + "/summary_r1.json"), read_json(other_disk + "/summary_r1.json"));
  EXPECT_FALSE(std::filesystem::exists(other_disk + "/summary.json")) << "worker 0 alone writes it";
}

// Issue 67 item 1: workers started by hand with different models (or lr)
// are told so before any step: worker 0 publishes the run's keys and worker
// 1, started first with hidden=48 and lr=0.01, is refused in one line naming
// both, instead of aborting inside Gloo at its first exchange. A machine's
// own keys (threads, log_interval, out) may differ.
TEST_F(Distributed, AWorkerStartedWithAnotherModelIsRefusedNamingTheKeys) {
  const std::string env = fmt::format("WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT={} NOLOCO_RUN_TOKEN=config-check",
                                      noloco::testing::free_port());
  // heartbeat_timeout: how long worker 0, writing the run's summary, waits for the refused one.
  const std::string run = " method=noloco batch=2 steps=4 outer_interval=2 peer_timeout=5 heartbeat_timeout=5";
  noloco::testing::BackgroundCli other(
      small_train_args(dir / "c.txt", dir / "other") + run + " hidden=48 lr=0.01 threads=1 log_interval=2", 60,
      "RANK=1 " + env);
  const auto first = noloco::testing::run_cli(small_train_args(dir / "c.txt", dir / "first") + run, 60, "RANK=0 " + env);
  const auto& refused = other.wait();
  EXPECT_EQ(first.exit_code, 0) << first.output;
  EXPECT_NE(refused.exit_code, 0) << refused.output;
  EXPECT_NE(refused.output.find("worker 1 was started with another config than the run's: hidden: 48 here, 32 in the "
                                "run; lr: 0.01 here, 0.001 in the run;"),
            std::string::npos)
      << refused.output;
  const auto from = refused.output.find("than the run's: "), to = refused.output.find("; only a machine's own keys");
  ASSERT_LT(from, to) << refused.output;
  const auto differences = refused.output.substr(from, to - from);
  EXPECT_EQ(differences.find("threads"), std::string::npos) << "the machine's own: " << differences;
  EXPECT_EQ(differences.find("log_interval"), std::string::npos) << "the machine's own: " << differences;
  EXPECT_EQ(refused.output.find("terminate called"), std::string::npos) << refused.output;
}

// Issue 29: a NoLoCo worker told to leave (SIGTERM) ends its step, applies
// what is in flight, tells the others not to wait for it, saves its state and
// exits 0; nobody waits for it, and the run ends with the others, exit 0.
TEST_F(Distributed, ANoLoCoWorkerLeavesOnSigtermAndNobodyWaitsForIt) {
  const std::string run_dir = dir / "leave";
  const int steps = 400;
  noloco::testing::BackgroundCli runner(
      small_train_args(dir / "c.txt", run_dir) +
          // A checkpoint every step: the step it leaves at already has one (leaving wrote over it, and failed).
          fmt::format(" method=noloco replicas=3 batch=2 steps={} outer_interval=5 heartbeat_timeout=60 "
                      "checkpoint_interval=1 keep_checkpoints=2",
                      steps),
      180);
  ASSERT_TRUE(noloco::testing::wait_for_record(run_dir, "outer", 90));
  const pid_t leaver = noloco::testing::worker_of(run_dir, 2);
  ASSERT_GT(leaver, 0);
  ASSERT_EQ(::kill(leaver, SIGTERM), 0);
  const auto& r = runner.wait();
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto summary = read_json(run_dir + "/summary.json");
  EXPECT_EQ(summary["replicas_finished"].get<std::vector<int>>(), (std::vector<int>{0, 1}));
  EXPECT_TRUE(summary["replicas_failed"].empty()) << summary.dump();
  ASSERT_EQ(summary["replicas_left"].size(), 1u) << summary.dump();
  EXPECT_EQ(summary["replicas_left"][0]["replica"].get<int>(), 2);
  const auto left = read_json(run_dir + "/summary_r2.json")["left_at_step"].get<int64_t>();
  EXPECT_GT(left, 0);
  EXPECT_LT(left, steps) << "it left before the end";
  // Its last state is the checkpoint of the step it left at, and loads.
  const auto last = find_checkpoint(run_dir + "/checkpoints/r2");
  EXPECT_NE(last.find(fmt::format("step_{:08d}", left)), std::string::npos) << last;
  EXPECT_FALSE(load_tensors(last + "/model.safetensors").empty());
  // Nobody waited for it: a partner waiting out peer_timeout (30 s) would show here.
  for (int replica : {0, 1})
    EXPECT_LT(read_json(fmt::format("{}/summary_r{}.json", run_dir, replica))["outer_blocked_seconds"].get<double>(),
              20.0)
        << "replica " << replica;
  EXPECT_EQ(r.output.find("timed out"), std::string::npos) << r.output;
}


// Issue 29: two new workers join a running 4-replica NoLoCo run (`noloco
// join RUN_DIR`, the token from the run_token file the launcher wrote): each
// takes a live replica's state, is drawn into the groupings, and the run
// finishes with six replicas whose final losses agree. A joiner with the
// wrong token, or one that sets a key of the run's, is refused with one line;
// the invitation goes with the run.
TEST_F(Distributed, TwoWorkersJoinARunningNoLoCoRunAndItFinishesWithSix) {
  const std::string run_dir = dir / "grow";
  const int steps = 1000, join_after = 100;
  noloco::testing::BackgroundCli runner(
      small_train_args(dir / "c.txt", run_dir) +
          fmt::format(" method=noloco replicas=4 batch=2 steps={} outer_interval=5 eval_interval=1000 "
                      "heartbeat_timeout=60 threads=1",
                      steps),
      300);
  ASSERT_TRUE(wait_for_step(run_dir, join_after, 120));
  struct stat token_file {};
  ASSERT_EQ(::stat((run_dir + "/run_token").c_str(), &token_file), 0);
  EXPECT_EQ(token_file.st_mode & 0777, 0600u) << "only its owner reads the token";
  const auto stranger = noloco::testing::run_cli("join " + run_dir + " threads=1", 60, "NOLOCO_RUN_TOKEN=not-the-token");
  // Issue 50 item 7: a joiner sets only what is its own; steps=4000 had trained alone past the run's end.
  const auto overriding = noloco::testing::run_cli("join " + run_dir + " threads=1 steps=4000", 60);
  EXPECT_NE(overriding.exit_code, 0) << overriding.output;
  EXPECT_NE(overriding.output.find("join: steps is the run's"), std::string::npos) << overriding.output;
  noloco::testing::BackgroundCli first("join " + run_dir + " threads=1", 280), second("join " + run_dir + " threads=1", 280);
  const auto& a = first.wait();
  const auto& b = second.wait();
  const auto& r = runner.wait();
  ASSERT_EQ(r.exit_code, 0) << r.output;
  ASSERT_EQ(a.exit_code, 0) << a.output;
  ASSERT_EQ(b.exit_code, 0) << b.output;
  EXPECT_NE(stranger.exit_code, 0) << stranger.output;
  EXPECT_NE(stranger.exit_code, 124) << "the stranger hung: " << stranger.output;
  EXPECT_NE(stranger.output.find("could not join the run"), std::string::npos) << stranger.output;
  EXPECT_FALSE(std::filesystem::exists(run_dir + "/join.json")) << "no invitation outlives the run";
  EXPECT_FALSE(std::filesystem::exists(run_dir + "/run_token"));

  const auto summary = read_json(run_dir + "/summary.json");
  EXPECT_EQ(summary["replicas_finished"].get<std::vector<int>>(), (std::vector<int>{0, 1, 2, 3, 4, 5}))
      << summary.dump();
  EXPECT_TRUE(summary["replicas_failed"].empty()) << summary.dump();
  ASSERT_EQ(summary["joined"].size(), 2u) << summary.dump();
  std::set<int> joiners;
  for (const auto& j : summary["joined"]) {
    joiners.insert(j["replica"].get<int>());
    EXPECT_GE(j["step"].get<int64_t>(), join_after) << j.dump();
    EXPECT_LT(j["step"].get<int64_t>(), steps) << j.dump();
    EXPECT_EQ(j["step"].get<int64_t>() % 5, 0) << "handed over after an outer step: " << j.dump();
    EXPECT_GE(j["donor"].get<int>(), 0);
    EXPECT_NE(j["donor"].get<int>(), j["replica"].get<int>());
  }
  EXPECT_EQ(joiners, (std::set<int>{4, 5}));

  // Drawn into the groupings: some first replica exchanged with a joiner.
  bool paired_with_joiner = false;
  for (auto& o : metrics_records(run_dir, "outer"))
    if (o["replica"].get<int>() < 4)
      for (int member : o["group"].get<std::vector<int>>()) paired_with_joiner |= member >= 4;
  EXPECT_TRUE(paired_with_joiner);

  // By the end the joiners' validation losses are the others' within 2%
  // (NoLoCo keeps the replicas close; a joiner starts from its donor's weights).
  std::map<int, double> final_loss;
  for (int replica = 0; replica < 6; ++replica)
    final_loss[replica] = read_json(fmt::format("{}/summary_r{}.json", run_dir, replica))["final_val_loss"].get<double>();
  const double others = (final_loss[0] + final_loss[1] + final_loss[2] + final_loss[3]) / 4;
  for (int replica : {4, 5}) EXPECT_NEAR(final_loss[replica], others, 0.02 * others) << "replica " << replica;
  EXPECT_EQ(r.output.find("timed out"), std::string::npos) << r.output;
}

// Issue 29: a joiner killed during its hand-over (a drill, once a donor has
// claimed it) leaves the run unharmed: it never becomes a member, the donor
// gives up the hand-over and trains on, and the run ends whole, exit 0.
// Issue 50 item 1: the donor waited out peer_timeout for its dead joiner
// without publishing progress, its partner gave it up, and the two replicas
// trained alone from then on. Now the donor stops when the joiner's heartbeat
// falls silent, its partner waits for it meanwhile, and they keep pairing.
TEST_F(Distributed, AJoinerThatDiesDuringItsHandOverLeavesTheRunUnharmed) {
  const std::string run_dir = dir / "failed_join";
  noloco::testing::BackgroundCli runner(
      small_train_args(dir / "c.txt", run_dir) +
          " method=noloco replicas=2 batch=2 steps=600 outer_interval=5 peer_timeout=10 heartbeat_timeout=5 threads=1",
      240);
  ASSERT_TRUE(wait_for_step(run_dir, 20, 120));
  const auto joiner = noloco::testing::run_cli("join " + run_dir + " threads=1 inject_crash=2:handover", 120);
  const auto& r = runner.wait();
  EXPECT_EQ(joiner.exit_code, 128 + SIGKILL) << joiner.output;
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("could not hand over state to replica 2"), std::string::npos) << r.output;
  const auto summary = read_json(run_dir + "/summary.json");
  EXPECT_EQ(summary["replicas_finished"].get<std::vector<int>>(), (std::vector<int>{0, 1})) << summary.dump();
  EXPECT_TRUE(summary["joined"].empty()) << summary.dump();
  EXPECT_TRUE(summary["replicas_failed"].empty()) << summary.dump();
  for (auto& o : metrics_records(run_dir, "outer"))
    for (int member : o["members"].get<std::vector<int>>()) EXPECT_LT(member, 2) << o.dump();
  EXPECT_EQ(summary.value("handovers_abandoned", -1.0), 1.0) << summary.dump();
  EXPECT_EQ(summary.value("handovers_served", -1.0), 0.0) << summary.dump();
  EXPECT_LE(summary.value("longest_alone_outer_steps", 99.0), 2.0) << summary.dump();
  EXPECT_GE(summary.value("paired_fraction_worst", 0.0), 0.9) << summary.dump();
  EXPECT_FALSE(summary.contains("replicas_mostly_alone")) << summary.dump();
}

// Issue 50 item 8: `noloco join store=URL` for a store that takes the
// connection and never answers was silent for twice peer_timeout (120 s)
// before its error. It says where it is reaching first, and gives up the
// first contact within seconds.
TEST_F(Distributed, AJoinerWhoseStoreDoesNotAnswerSaysSoWithinSeconds) {
  const std::string run_dir = dir / "hung_store";
  std::filesystem::create_directories(run_dir);
  noloco::testing::write_text(run_dir + "/config.yaml", "data: " + (dir / "c.txt") + "\nmethod: noloco\nreplicas: 2\n");
  // A listening socket that nobody accepts on: the kernel completes the
  // handshake, and the request waits for an answer that never comes.
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  ASSERT_EQ(::listen(fd, 16), 0);
  socklen_t length = sizeof(a);
  ASSERT_EQ(::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &length), 0);
  const auto start = std::chrono::steady_clock::now();
  const auto r = noloco::testing::run_cli(
      fmt::format("join {} store=http://127.0.0.1:{} threads=1", run_dir, ntohs(a.sin_port)), 90,
      "NOLOCO_RUN_TOKEN=hung-store-test");
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ::close(fd);
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_LT(seconds, 45.0) << r.output;
  EXPECT_NE(r.output.find("join: reaching the run's store at http://127.0.0.1:"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("could not use the run's store at"), std::string::npos) << r.output;
}

// Issue 66: a worker that has not trained a step has nothing to hand back,
// so SIGTERM ends it at once. A joiner waiting for a live replica's state
// (here every replica is frozen) ignored SIGTERM until its wait ran out (600
// s); it now ends within seconds with 143, and the run, thawed, finishes.
TEST_F(Distributed, ASigtermEndsAJoinerStillWaitingForItsStateAtOnce) {
  const std::string run_dir = dir / "frozen_donors", log = dir / "joiner.log";
  noloco::testing::BackgroundCli runner(small_train_args(dir / "c.txt", run_dir) +
                                            " method=noloco replicas=2 batch=2 steps=1000000 outer_interval=5 "
                                            "heartbeat_timeout=120 peer_timeout=10 threads=1",
                                        180);
  ASSERT_TRUE(wait_for_step(run_dir, 20, 120));
  const pid_t first = noloco::testing::worker_of(run_dir, 0), second = noloco::testing::worker_of(run_dir, 1);
  ASSERT_GT(first, 0);
  ASSERT_GT(second, 0);
  ::kill(first, SIGSTOP);
  ::kill(second, SIGSTOP);
  noloco::testing::BackgroundCli joiner("join " + run_dir + " threads=1 > " + log, 120);
  bool waiting = false;
  for (int i = 0; i < 600 && !waiting; ++i) {
    waiting = std::filesystem::exists(log) &&
              noloco::testing::read_text(log).find("waiting for a live replica's state") != std::string::npos;
    if (!waiting) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  const auto t0 = std::chrono::steady_clock::now();
  ::system(("pkill -TERM -f '^" NOLOCO_BINARY " join " + run_dir + " '").c_str());
  const auto& joined = joiner.wait();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ::kill(first, SIGCONT);
  ::kill(second, SIGCONT);
  if (const pid_t launcher = noloco::testing::launcher_of(run_dir); launcher > 0) ::kill(launcher, SIGTERM);
  const auto& ran = runner.wait();
  EXPECT_TRUE(waiting) << noloco::testing::read_text(log);
  EXPECT_EQ(joined.exit_code, 128 + SIGTERM) << noloco::testing::read_text(log);
  EXPECT_LT(seconds, 10) << "ended " << seconds << " s after SIGTERM";
  EXPECT_NE(ran.exit_code, 124) << ran.output;
  EXPECT_TRUE(std::filesystem::exists(run_dir + "/summary.json")) << ran.output;
}

// The first python3 on PATH may lack torch or noloco (a pyenv shim, a bare
// venv): once every worker failed, launch names the interpreter it ran and
// what its import said; an interpreter that imports both is not blamed.
TEST(Launch, AnInterpreterWithoutNolocoIsNamedWhenEveryWorkerFails) {
  noloco::testing::TempDir dir;
  const std::string python = dir / "python3";
  for (const bool imports : {false, true}) {
    SCOPED_TRACE(imports ? "imports both" : "has no torch");
    noloco::testing::write_text(
        python, fmt::format("#!/bin/sh\nif [ \"$1\" = -c ] && {}; then exit 0; fi\n"
                            "echo \"ModuleNotFoundError: No module named 'torch'\" >&2\nexit 1\n",
                            imports ? "true" : "false"));
    ::chmod(python.c_str(), 0755);
    const auto r = noloco::testing::run_cli("launch 2 -- python3 loop.py", 60, "PATH=" + dir.path() + ":$PATH");
    EXPECT_EQ(r.exit_code, 1) << r.output;
    EXPECT_NE(r.output.find("all 2 workers failed"), std::string::npos) << r.output;
    const std::string blamed = "python3 (" + python + ") cannot import torch and noloco (ModuleNotFoundError: No module named 'torch')";
    EXPECT_EQ(r.output.find(blamed) != std::string::npos, !imports) << r.output;
  }
}

// Issue 67 item 4: under torchrun (a c10d rendezvous, as --standalone's, so
// worker 0 hosts the run's store) nobody declares a killed rank dead: the
// others, stopped by the agent's SIGTERM, waited out heartbeat_timeout (30 s)
// for it, in their last exchange and in worker 0's wait for the store's
// users, until the agent's grace ran out. Asked to stop, a worker gives a
// silent partner a few beats, and ends with its summary.
TEST_F(Distributed, UnderTorchrunWorkersStoppedAfterARankWasKilledDoNotWaitOutItsHeartbeat) {
  const std::string run = dir / "torchrun";
  const auto done = noloco::testing::run_command(
      fmt::format("{} -m torch.distributed.run --nnodes=1 --nproc_per_node=3 --rdzv_backend=c10d "
                  "--rdzv_endpoint=127.0.0.1:{} --redirects=2 --tee=2 --no_python {} {} method=noloco replicas=3 "
                  "batch=2 steps=1000000 outer_interval=10 inject_crash=1:30",
                  NOLOCO_TORCH_PYTHON, noloco::testing::free_port(), NOLOCO_BINARY,
                  small_train_args(dir / "c.txt", run)),
      150, "NOLOCO_RUN_TOKEN=torchrun-test");
  const std::string& output = done.output;
  ASSERT_LT(done.exit_code, 128) << "ended by a signal:\n" << output;  // torchrun's own exit, not a kill
  EXPECT_NE(done.exit_code, 124) << "timed out:\n" << output;
  for (const int r : {0, 2}) {
    ASSERT_TRUE(std::filesystem::exists(fmt::format("{}/summary_r{}.json", run, r))) << output;
    const auto summary = read_json(fmt::format("{}/summary_r{}.json", run, r));
    EXPECT_TRUE(summary.contains("left_at_step")) << "worker " << r << " left the run: " << summary.dump();
    EXPECT_LT(summary["seconds"].get<double>(), 20) << "waited out the heartbeat timeout (30 s): " << summary.dump();
  }
  // Issue 83 item 8: rank 0, which writes the run's summary, left too; the run's figures are what was trained.
  const auto run_summary = read_json(run + "/summary.json");
  EXPECT_GE(run_summary["steps"].get<int64_t>(), 30) << run_summary.dump();
  EXPECT_GT(run_summary["tokens"].get<int64_t>(), 0) << run_summary.dump();
  EXPECT_GT(run_summary["params"].get<int64_t>(), 0) << run_summary.dump();
}
