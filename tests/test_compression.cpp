// Compressed outer steps in real multi-process runs (loopback, bounded):
// message sizes on the wire, DiLoCo's compressed mean identical everywhere,
// and the compression state resumed bit for bit.
#include <gtest/gtest.h>

#include <set>

#include <algorithm>
#include <map>

#include <fmt/format.h>
#include <yaml-cpp/yaml.h>

#include "wire/codec.h"
#include "wire/coset_codec.h"
#include "wire/message.h"
#include "comm/transport/seal.h"
#include "optim/low_rank.h"
#include "test_util.h"
#include "train/checkpoint.h"
#include "util/files.h"

using namespace noloco;
using noloco::testing::metrics_records;

namespace {

class Compression : public noloco::testing::LaunchedRuns {
 protected:
  void count_every_byte_and_resume(const std::string& preset);
};

CodecSpec int_spec(CodecSpec::Type type) {
  CodecSpec s;
  s.type = type;
  return s;
}

}  // namespace

TEST_F(Compression, NoLoCoSendsInt4DeltaAndCosetCodedSlowWeights) {
  const auto out = run("int4", "method=noloco replicas=2 batch=2 steps=12 outer_interval=3 wire_dtype=int4");
  const auto r0 = read_json(out + "/summary_r0.json");
  const auto n = r0["params"].get<size_t>();
  // The header travels with each message and counts, and so do the link's frames and its stream's start.
  const uint64_t message = noloco::testing::sealed_message(WireCodec(int_spec(CodecSpec::Type::int4)).encoded_bytes(n) +
                                                           CosetCodec(4, 64).encoded_bytes(n));
  const uint64_t sent = 4 * message + noloco::testing::kLinkStart;
  EXPECT_EQ(r0["bytes_sent"].get<uint64_t>(), sent) << "one message per outer step, over one link";
  // What decoding dropped: the φ blocks outside their grid, of the 2n values
  // (Δ and φ) in each of the 4 messages received.
  int64_t failed = 0;
  for (auto& rec : metrics_records(out, "outer"))
    if (rec["replica"] == 0) failed += rec["phi_blocks_failed"].get<int64_t>();
  EXPECT_DOUBLE_EQ(r0["dropped_fraction"].get<double>(), double(failed * 64) / double(4 * 2 * n));
  // The worst outer step: of this replica, and of any replica in the run's summary.
  double worst_r0 = 0, worst = 0;
  for (auto& rec : metrics_records(out, "outer")) {
    const double dropped = double(rec["phi_blocks_failed"].get<int64_t>() * 64) / double(2 * n);
    EXPECT_DOUBLE_EQ(rec["dropped_fraction"].get<double>(), dropped);
    worst = std::max(worst, dropped);
    if (rec["replica"] == 0) worst_r0 = std::max(worst_r0, dropped);
  }
  EXPECT_DOUBLE_EQ(r0["dropped_fraction_worst_outer_step"].get<double>(), worst_r0);
  EXPECT_DOUBLE_EQ(read_json(out + "/summary.json")["dropped_fraction_worst_outer_step"].get<double>(), worst);
  EXPECT_NEAR(r0["bits_per_param_per_outer_step"].get<double>(), 8.0 * double(sent) / 4.0 / double(n), 1e-9);
  EXPECT_LT(r0["bits_per_param_per_outer_step"].get<double>(), 9.0);  // against 32 in fp32
  for (auto& rec : metrics_records(out, "outer")) EXPECT_EQ(rec["arrived"].size(), 2u) << rec.dump();
  const auto config = read_file(out + "/config.yaml");
  EXPECT_NE(config.find("noloco_message: delta_phi"), std::string::npos) << "a lossy codec sends Δ and φ";
  EXPECT_NE(config.find("phi_coding: coset"), std::string::npos);
}

TEST_F(Compression, DiLoCoCompressedMeanIsTheSameOnEveryReplica) {
  const auto out = run("int8", "method=diloco replicas=3 batch=2 steps=8 outer_interval=4 wire_dtype=int8");
  std::vector<TensorMap> weights;
  for (int r = 0; r < 3; ++r)
    weights.push_back(load_tensors(find_checkpoint(out + fmt::format("/checkpoints/r{}", r)) + "/model.safetensors"));
  for (auto& [name, t] : weights[0]) {
    EXPECT_TRUE(torch::equal(t, weights[1].at(name))) << name;
    EXPECT_TRUE(torch::equal(t, weights[2].at(name))) << name;
  }
  const auto r1 = read_json(out + "/summary_r1.json");
  const auto n = r1["params"].get<size_t>(), shard = (n + 2) / 3;
  const size_t chunk = WireCodec(int_spec(CodecSpec::Type::int8)).encoded_bytes(shard);
  // An all-to-all and an all-gather of compressed shards: 2·(N−1) chunks a
  // replica per outer step, each a message on its link to a peer.
  EXPECT_EQ(r1["bytes_sent"].get<uint64_t>(),
            2 * (2 * 2 * noloco::testing::sealed_message(chunk)) + 2 * noloco::testing::kLinkStart);
  EXPECT_EQ(r1["collectives"].get<int64_t>(), 2 * 2);
}

TEST_F(Compression, ErrorFeedbackAndCosetStateResumeBitIdentically) {
  const std::string common =
      "method=noloco replicas=2 batch=2 outer_interval=3 decay_steps=12 checkpoint_interval=3 wire_dtype=int4 topk=0.3 "
      "error_feedback_decay=0.9";
  const auto whole = run("whole", common + " steps=12");
  run("split", common + " steps=6");
  const auto split = run("split", common + " steps=12 resume=true");
  noloco::testing::expect_same_train_losses(whole, split, 24);
  for (int r = 0; r < 2; ++r) {
    const auto sub = fmt::format("/checkpoints/r{}", r);
    const auto sa = load_tensors(find_checkpoint(whole + sub) + "/state.safetensors");
    const auto sb = load_tensors(find_checkpoint(split + sub) + "/state.safetensors");
    for (const char* key : {"outer.residual", "outer.phi_range", "outer.phi", "outer.momentum"}) {
      ASSERT_TRUE(sa.count(key)) << key;
      EXPECT_TRUE(torch::equal(sa.at(key), sb.at(key))) << key;
    }
    EXPECT_GT(sa.at("outer.residual").abs().max().item<float>(), 0) << "top-k int4 leaves something owed";
  }
}

// compression=sparse for DiLoCo: int2 Δ through the reduce-scatter, one
// fragment of the weights an outer step. The bits counted per outer step are
// the bytes the transport sent, sealed, over the outer steps taken; every
// replica applies the same mean, and a resumed run (error feedback of each
// fragment's shards included) continues bit for bit.
TEST_F(Compression, SparseDiLoCoSendsOneInt2FragmentAnOuterStepAndResumesBitIdentically) {
  const std::string common = "method=diloco compression=sparse replicas=3 batch=2 outer_interval=4 fragments=2 "
                             "decay_steps=12 checkpoint_interval=3";
  const auto whole = run("whole", common + " steps=12");
  const auto config = YAML::LoadFile(whole + "/config.yaml");
  EXPECT_EQ(config["wire_dtype"].as<std::string>(), "int2");
  EXPECT_EQ(config["diloco_mean"].as<std::string>(), "reduce_scatter");
  EXPECT_EQ(config["outer_interval"].as<int>(), 4) << "a key given with the preset overrides it";
  const auto r1 = read_json(whole + "/summary_r1.json");
  const auto n = r1["params"].get<size_t>();
  // Fragments of n/2 values (the first takes the odd one), each split into 3 shards.
  const WireCodec int2(int_spec(CodecSpec::Type::int2));
  uint64_t per_round = 0;
  for (size_t f = 0; f < 2; ++f) {
    const size_t numel = n / 2 + (f < n % 2 ? 1 : 0), shard = (numel + 2) / 3;
    // All-to-all and all-gather, 2 peers each, a message on each link.
    per_round += 2 * 2 * noloco::testing::sealed_message(int2.encoded_bytes(shard));
  }
  const uint64_t sent = 3 * per_round + 2 * noloco::testing::kLinkStart;
  EXPECT_EQ(r1["bytes_sent"].get<uint64_t>(), sent) << "12 steps: 3 syncs of each fragment";
  EXPECT_NEAR(r1["bits_per_param_per_outer_step"].get<double>(), 8.0 * double(sent) / 6.0 / double(n), 1e-9)
      << "6 outer steps, each one fragment";
  EXPECT_DOUBLE_EQ(r1["steps_per_outer_step"].get<double>(), 2.0);
  int outer_records = 0;
  for (auto& rec : metrics_records(whole, "outer"))
    if (rec["replica"] == 1) ++outer_records;
  EXPECT_EQ(outer_records, 6);

  run("split", common + " steps=6");
  const auto split = run("split", common + " steps=12 resume=true");
  noloco::testing::expect_same_train_losses(whole, split, 36);
  std::vector<TensorMap> states;
  for (int r = 0; r < 3; ++r)
    states.push_back(load_tensors(find_checkpoint(whole + fmt::format("/checkpoints/r{}", r)) + "/state.safetensors"));
  for (const char* key : {"outer.residual_shard0.f0", "outer.residual_mean.f1"})
    ASSERT_TRUE(states[0].count(key)) << key << ": each fragment's error feedback is checkpointed";
  EXPECT_TRUE(torch::equal(states[0].at("outer.phi"), states[1].at("outer.phi")));
  EXPECT_TRUE(torch::equal(states[0].at("outer.phi"), states[2].at("outer.phi")));
}

// compression=sparse for NoLoCo: int2 Δ to one partner, φ coset-coded in 4
// bits every 2nd outer step of a fragment; bits per outer step from the
// transport's bytes, and what decoding dropped reported.
TEST_F(Compression, SparseNoLoCoSendsInt2DeltaAndCosetCodedSlowWeightsOneFragmentAnOuterStep) {
  const auto out = run("noloco", "method=noloco compression=sparse replicas=2 batch=2 steps=16 outer_interval=4 "
                                 "fragments=2");
  const auto r0 = read_json(out + "/summary_r0.json");
  const auto n = r0["params"].get<size_t>();
  const WireCodec int2(int_spec(CodecSpec::Type::int2));
  const CosetCodec coset(4, 64);
  uint64_t bytes = noloco::testing::kLinkStart;
  for (size_t f = 0; f < 2; ++f) {
    const size_t numel = n / 2 + (f < n % 2 ? 1 : 0);
    // 4 outer steps of each fragment, φ on the 2nd and 4th.
    bytes += 2 * noloco::testing::sealed_message(int2.encoded_bytes(numel)) +
             2 * noloco::testing::sealed_message(int2.encoded_bytes(numel) + coset.encoded_bytes(numel));
  }
  EXPECT_EQ(r0["bytes_sent"].get<uint64_t>(), bytes);
  EXPECT_NEAR(r0["bits_per_param_per_outer_step"].get<double>(), 8.0 * double(bytes) / 8.0 / double(n), 1e-9);
  EXPECT_DOUBLE_EQ(r0["steps_per_outer_step"].get<double>(), 2.0);
  int64_t failed = 0, with_phi = 0;
  for (auto& rec : metrics_records(out, "outer"))
    if (rec["replica"] == 0) {
      failed += rec["phi_blocks_failed"].get<int64_t>();
      if (rec["outer_step"].get<int>() % 2 == 1) ++with_phi;
    }
  EXPECT_EQ(with_phi, 4);
  EXPECT_DOUBLE_EQ(r0["dropped_fraction"].get<double>(), double(failed * 64) / double(6 * n))
      << "each fragment's 4 messages carry its Δ, 2 of them its φ as well";
}

// The messages of issue 47. compression=topk: the top 64 of each 4096 values
// of Δ as 2-bit bin means with Rice-coded positions, what it leaves out kept
// in the weights; NoLoCo sends one such message to its partner an outer step
// and no slow weights, DiLoCo all-gathers them (2 messages a replica at 3
// replicas). The same with message_rank=2 and int8 instead: each matrix of Δ
// as rank-2 factors, vectors as they are.
// bits_per_param_per_inner_step is every byte sent × 8 / (parameters × inner
// steps), in summary.json and, running, in metrics.jsonl; resumed runs
// continue bit for bit (the low-rank factors' sketch is seeded, not state).
// One preset's runs (two tests, so that ctest -j runs them side by side).
void Compression::count_every_byte_and_resume(const std::string& preset) {
  CodecSpec sparse = int_spec(CodecSpec::Type::bins2);
  sparse.topk = 64.0 / 4096;
  const WireCodec topk(sparse), int8(int_spec(CodecSpec::Type::int8));
  for (const std::string method : {"noloco", "diloco"}) {
    SCOPED_TRACE(preset + " " + method);
    const std::string message =
        preset == "topk" ? "compression=topk" : "compression=topk topk=0 wire_dtype=int8 message_rank=2";
    const std::string common = "method=" + method + " " + message +
                               " replicas=3 batch=2 outer_interval=4 decay_steps=16 checkpoint_interval=4";
    const std::string name = preset + "_" + method;
    const auto whole = run(name + "_whole", common + " steps=16");
    const auto r1 = read_json(whole + "/summary_r1.json");
    const auto n = r1["params"].get<uint64_t>();
    // What one outer step sends to each partner (NoLoCo) or all-gathers (DiLoCo).
    uint64_t to_partner = noloco::testing::sealed_message(topk.encoded_bytes(n)), gathered = to_partner;
    if (preset == "lowrank") {
      const auto weights = load_tensors(find_checkpoint(whole + "/checkpoints/r1") + "/model.safetensors");
      FlatParams flat(std::vector<std::pair<std::string, torch::Tensor>>(weights.begin(), weights.end()));
      ASSERT_EQ(uint64_t(flat.numel()), n);
      const LowRankCoding coding(flat, 0, flat.numel(), 2);
      EXPECT_LT(coding.coded_values(), flat.numel() / 4);
      to_partner = gathered = noloco::testing::sealed_message(int8.encoded_bytes(size_t(coding.coded_values())));
    }
    // NoLoCo: to each other member of its group (at 3 replicas, a replica may be alone).
    // Each link's stream starts once: DiLoCo's two, or one to each partner NoLoCo met.
    uint64_t expected = 0;
    int outer_steps = 0;
    std::set<int> partners;
    for (auto& rec : metrics_records(whole, "outer")) {
      if (rec["replica"] != 1) continue;
      ++outer_steps;
      if (method == "diloco") expected += 2 * gathered;
      else expected += (rec["group"].size() - 1) * to_partner;
      for (int member : rec["group"].get<std::vector<int>>())
        if (member != 1) partners.insert(member);
    }
    expected += (method == "diloco" ? 2 : partners.size()) * noloco::testing::kLinkStart;
    EXPECT_EQ(outer_steps, 4);
    EXPECT_EQ(r1["bytes_sent"].get<uint64_t>(), expected);
    EXPECT_NEAR(r1["bits_per_param_per_inner_step"].get<double>(), 8.0 * double(expected) / double(n) / 16.0,
                1e-12);
    const auto train_records = metrics_records(whole, "train");
    ASSERT_FALSE(train_records.empty());
    EXPECT_TRUE(train_records.back().contains("bits_per_param_per_inner_step"));
    if (method == "noloco")
      for (auto& rec : metrics_records(whole, "outer"))
        EXPECT_EQ(rec["phi_blocks_failed"].get<int64_t>(), 0) << "no slow weights travel";

    run(name + "_split", common + " steps=8");
    const auto split = run(name + "_split", common + " steps=16 resume=true");
    noloco::testing::expect_same_train_losses(whole, split, 48);
  }
}

TEST_F(Compression, TopKMessagesCountEveryByteSentPerInnerStepAndResumeBitIdentically) {
  count_every_byte_and_resume("topk");
}

TEST_F(Compression, LowRankMessagesCountEveryByteSentPerInnerStepAndResumeBitIdentically) {
  count_every_byte_and_resume("lowrank");
}
