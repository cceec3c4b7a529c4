// Compressed outer steps in real multi-process runs (loopback, bounded):
// message sizes on the wire, DiLoCo's compressed mean identical everywhere,
// and the compression state resumed bit for bit.
#include <gtest/gtest.h>

#include <map>

#include <fmt/format.h>
#include <yaml-cpp/yaml.h>

#include "wire/codec.h"
#include "wire/coset_codec.h"
#include "wire/message.h"
#include "comm/seal.h"
#include "test_util.h"
#include "train/checkpoint.h"
#include "util/files.h"

using namespace noloco;
using noloco::testing::metrics_records;

namespace {

class Compression : public noloco::testing::LaunchedRuns {};

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
  // The header travels with each message and counts, and so do the seal's nonce and tag.
  const size_t message = MessageHeader::kBytes + Seal::kOverhead +
                         WireCodec(int_spec(CodecSpec::Type::int4)).encoded_bytes(n) + CosetCodec(4, 64).encoded_bytes(n);
  EXPECT_EQ(r0["bytes_sent"].get<uint64_t>(), 4 * message) << "one message per outer step";
  // What decoding dropped: the φ blocks outside their grid, of the 2n values
  // (Δ and φ) in each of the 4 messages received.
  int64_t failed = 0;
  for (auto& rec : metrics_records(out, "outer"))
    if (rec["replica"] == 0) failed += rec["phi_blocks_failed"].get<int64_t>();
  EXPECT_DOUBLE_EQ(r0["dropped_fraction"].get<double>(), double(failed * 64) / double(4 * 2 * n));
  EXPECT_NEAR(r0["bits_per_param_per_outer_step"].get<double>(), 8.0 * double(message) / double(n), 1e-9);
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
  // An all-to-all and an all-gather of compressed shards: 2·(N−1) chunks a replica per outer step, each sealed.
  EXPECT_EQ(r1["bytes_sent"].get<uint64_t>(), 2 * (2 * 2 * (chunk + Seal::kOverhead)));
  EXPECT_EQ(r1["collectives"].get<int64_t>(), 2 * 2);
}

TEST_F(Compression, ErrorFeedbackAndCosetStateResumeBitIdentically) {
  const std::string common =
      "method=noloco replicas=2 batch=2 outer_interval=3 decay_steps=12 checkpoint_interval=3 wire_dtype=int4 topk=0.3 "
      "error_feedback_decay=0.9";
  const auto whole = run("whole", common + " steps=12");
  run("split", common + " steps=6");
  const auto split = run("split", common + " steps=12 resume=true");
  const auto a = noloco::testing::train_losses(whole), b = noloco::testing::train_losses(split);
  ASSERT_EQ(a.size(), 24u);
  for (auto& [key, loss] : a) EXPECT_EQ(b.at(key), loss) << "replica " << key.first << " step " << key.second;
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

// compression=sparse for DiLoCo: each replica's Δ, top-k and int4,
// compressed once and all-gathered, so the bytes are (N−1) messages a replica
// per outer step; every replica applies the same mean to the same φ, and a
// resumed run continues bit for bit.
TEST_F(Compression, SparseDiLoCoGathersOneMessageAReplicaAndResumesBitIdentically) {
  const std::string common = "method=diloco compression=sparse replicas=3 batch=2 outer_interval=3 decay_steps=12 "
                             "checkpoint_interval=3";
  const auto whole = run("whole", common + " steps=12");
  const auto config = read_file(whole + "/config.yaml");
  EXPECT_NE(config.find("diloco_mean: all_gather"), std::string::npos) << config;
  EXPECT_NE(config.find("outer_interval: 3"), std::string::npos) << "a key given with the preset overrides it";
  const auto r1 = read_json(whole + "/summary_r1.json");
  const auto n = r1["params"].get<size_t>();
  CodecSpec s = int_spec(CodecSpec::Type::int4);
  s.topk = YAML::LoadFile(whole + "/config.yaml")["topk"].as<double>();
  const uint64_t message = WireCodec(s).encoded_bytes(n) + Seal::kOverhead;
  EXPECT_EQ(r1["bytes_sent"].get<uint64_t>(), 4 * 2 * message) << "4 outer steps, each gathering 2 others' messages";
  EXPECT_NEAR(r1["bits_per_param_per_outer_step"].get<double>(), 8.0 * 2 * double(message) / double(n), 1e-9);
  EXPECT_LT(r1["bits_per_param_per_outer_step"].get<double>(), 0.5);

  run("split", common + " steps=6");
  const auto split = run("split", common + " steps=12 resume=true");
  const auto a = noloco::testing::train_losses(whole), b = noloco::testing::train_losses(split);
  ASSERT_EQ(a.size(), 36u);
  for (auto& [key, loss] : a) EXPECT_EQ(b.at(key), loss) << "replica " << key.first << " step " << key.second;
  // What the messages left out stays in each replica's weights (residual=weights):
  // the slow weights agree everywhere, the weights do not, and no buffer is kept.
  std::vector<TensorMap> states;
  for (int r = 0; r < 3; ++r)
    states.push_back(load_tensors(find_checkpoint(whole + fmt::format("/checkpoints/r{}", r)) + "/state.safetensors"));
  EXPECT_EQ(states[0].count("outer.residual"), 0u);
  EXPECT_TRUE(torch::equal(states[0].at("outer.phi"), states[1].at("outer.phi")));
  EXPECT_TRUE(torch::equal(states[0].at("outer.phi"), states[2].at("outer.phi")));
  const auto last_checkpoint = [&](int r) {
    return load_tensors(find_checkpoint(whole + fmt::format("/checkpoints/r{}", r)) + "/model.safetensors");
  };
  const auto w0 = last_checkpoint(0), w1 = last_checkpoint(1);
  bool differ = false;
  for (auto& [name, t] : w0) differ = differ || !torch::equal(t, w1.at(name));
  EXPECT_TRUE(differ) << "each replica keeps its own leftover";
}
