// Issue 80: our files against the real libraries users read them with
// (transformers, tokenizers, safetensors, TensorBoard; versions pinned in
// requirements-dev.txt, run offline by tests/python/ecosystem.py): what
// transformers saves, we import with its logits; what we export, it loads
// and continues token for token as `noloco generate` does; the tokenizers
// library's byte-level BPE gives our ids; safetensors opens our checkpoints;
// TensorBoard's reader finds metrics.jsonl's values in our event files.
#include <gtest/gtest.h>

#include <filesystem>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "data/tokenizer.h"
#include "model/hf_directory.h"
#include "test_util.h"
#include "data/token_file.h"
#include "train/checkpoint.h"
#include "train/export.h"
#include "util/files.h"
#include "util/tensor_file.h"

using namespace noloco;
using noloco::testing::run_ecosystem;
namespace fs = std::filesystem;

namespace {

const std::string kIds = "[[1,5,2,9,3,7,30,36,60,96],[4,4,0,10,7,2,11,12,95,1]]";

torch::Tensor ids_tensor() {
  return torch::tensor({{1, 5, 2, 9, 3, 7, 30, 36, 60, 96}, {4, 4, 0, 10, 7, 2, 11, 12, 95, 1}}, torch::kInt64);
}

LlamaForCausalLM imported(const std::string& dir) {
  LlamaForCausalLM model(read_hf_config(dir));
  load_hf_weights(model, dir);
  model->eval();
  return model;
}

torch::Tensor logits_of(LlamaForCausalLM& model, const torch::Tensor& ids) {
  torch::NoGradGuard g;
  return model->forward(ids);
}

double largest_difference(const torch::Tensor& a, const torch::Tensor& b) {
  return (a - b).abs().max().item<double>();
}

// One small trained run shared by the tests that read what a run writes: a
// tied head and grouped-query attention, checkpointed and evaluated, trained
// far enough (val loss 2.3) that greedy decoding is no longer one repeated token.
class TrainedRun : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new noloco::testing::TempDir();
    noloco::testing::write_text(*dir_ / "c.txt", noloco::testing::shakespeare(20000));
    const auto r = noloco::testing::run_cli(
        noloco::testing::small_train_args(*dir_ / "c.txt", *dir_ / "run") +
            " heads=4 kv_heads=2 tie_embeddings=true steps=400 decay_steps=400 lr=1e-2 eval_interval=100"
            " checkpoint_interval=400",
        180);
    ASSERT_EQ(r.exit_code, 0) << r.output;
  }
  static void TearDownTestSuite() {
    delete dir_;
    dir_ = nullptr;
  }
  static std::string run() { return *dir_ / "run"; }
  static std::string path(const std::string& name) { return *dir_ / name; }
  static noloco::testing::TempDir* dir_;
};
noloco::testing::TempDir* TrainedRun::dir_ = nullptr;

}  // namespace

// transformers 5 writes rotary settings as rope_parameters (theta included):
// read as before, its theta was taken for 10000 and the logits were another model's.
TEST(Ecosystem, WhatTransformersSavesImportsWithItsLogits) {
  struct Case {
    std::string name, flags;
    bool sharded;
  };
  const std::vector<Case> cases = {
      {"plain", "--kv-heads 4", false},
      {"llama3_rope_tied_gqa_sharded", "--kv-heads 2 --tied --llama3-rope --max-shard-size 60KB", true},
      {"head_dim_of_its_own", "--kv-heads 1 --head-dim 24 --max-shard-size 100KB", true}};
  noloco::testing::TempDir dir;
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    const std::string out = dir / c.name;
    const auto saved = run_ecosystem(fmt::format("save_llama {} --ids '{}' {}", out, kIds, c.flags));
    ASSERT_EQ(saved.exit_code, 0) << saved.output;
    EXPECT_EQ(fs::exists(out + "/model.safetensors.index.json"), c.sharded);
    auto model = imported(out);
    const auto expected = load_tensors(out + "/expected_logits.safetensors").at("logits");
    const auto ours = logits_of(model, ids_tensor());
    ASSERT_EQ(ours.sizes(), expected.sizes());
    const double difference = largest_difference(ours, expected);
    std::printf("%s: largest logit difference from transformers %.2e (logits' scale %.2e)\n", c.name.c_str(),
                difference, expected.abs().max().item<double>());
    EXPECT_LT(difference, 1e-4);
  }
}

// Issue 103: continuing a model transformers saved is one command, with no
// config file and no shape key, and its export is the model it came as:
// config.json field by field (4,096 positions though trained at 64), logits
// the run's.
TEST(Ecosystem, AModelTransformersSavedContinuesWithoutShapeKeysAndExportsItsOwnConfig) {
  noloco::testing::TempDir dir;
  const auto saved = run_ecosystem(fmt::format("save_llama {} --ids '{}' --kv-heads 2 --max-shard-size 60KB "
                                               "--max-positions 4096", dir / "llama", kIds));
  ASSERT_EQ(saved.exit_code, 0) << saved.output;
  ASSERT_TRUE(fs::exists(dir / "llama/model.safetensors.index.json")) << "sharded";
  std::vector<int32_t> train(6000), val(600);
  for (size_t i = 0; i < train.size(); ++i) train[i] = int32_t((i * 7 + i / 13) % 97);
  for (size_t i = 0; i < val.size(); ++i) val[i] = int32_t((i * 5 + i / 11) % 97);
  write_token_file(dir / "train.bin", train);
  write_token_file(dir / "val.bin", val);
  const auto trained = noloco::testing::run_cli(
      "train init_from=" + dir / "llama" + " data=" + dir / "train.bin" + " val_data=" + dir / "val.bin" +
          " context=64 batch=2 steps=5 warmup=1 eval_interval=5 eval_batches=2 sample_tokens=0 out=" + dir / "run",
      180);
  ASSERT_EQ(trained.exit_code, 0) << trained.output;
  const auto exported = noloco::testing::run_cli("export " + dir / "run" + " " + dir / "hf", 60);
  ASSERT_EQ(exported.exit_code, 0) << exported.output;
  EXPECT_NE(exported.output.find("config.json: init_from's, unchanged"), std::string::npos) << exported.output;
  const auto theirs = read_json(dir / "llama/config.json"), ours = read_json(dir / "hf/config.json");
  EXPECT_EQ(ours["max_position_embeddings"], 4096);
  for (const auto& [key, value] : theirs.items()) EXPECT_EQ(ours.value(key, nlohmann::json()), value) << key;
  EXPECT_EQ(ours.size(), theirs.size());
  const auto logits = run_ecosystem(
      fmt::format("logits {} --ids '{}' --out {}", dir / "hf", kIds, dir / "theirs.safetensors"));
  ASSERT_EQ(logits.exit_code, 0) << logits.output;
  auto run = load_trained_model(dir / "run");
  const auto difference =
      largest_difference(logits_of(run.model, ids_tensor()), load_tensors(dir / "theirs.safetensors").at("logits"));
  std::printf("largest logit difference, transformers on the export against the run: %.2e\n", difference);
  EXPECT_LT(difference, 1e-4);
}

TEST_F(TrainedRun, TransformersLoadsOurExportAndContinuesAPromptTokenForToken) {
  ExportOptions fp32;
  fp32.shard_bytes = 30000;
  export_hf(run(), path("hf32"), fp32);
  ASSERT_TRUE(fs::exists(path("hf32/model.safetensors.index.json"))) << "sharded";
  const auto theirs = run_ecosystem(fmt::format("logits {} --ids '{}' --out {}", path("hf32"), "[[1,5,2,9,3,7,30,36]]",
                                                path("theirs.safetensors")));
  ASSERT_EQ(theirs.exit_code, 0) << theirs.output;
  auto trained = load_trained_model(run());
  const auto ours = logits_of(trained.model, torch::tensor({{1, 5, 2, 9, 3, 7, 30, 36}}, torch::kInt64));
  const auto difference = largest_difference(ours, load_tensors(path("theirs.safetensors")).at("logits"));
  std::printf("largest logit difference from transformers on our export: %.2e\n", difference);
  EXPECT_LT(difference, 1e-4);

  ExportOptions bf16;
  bf16.shard_bytes = 20000;
  bf16.dtype = "bfloat16";
  export_hf(run(), path("hf16"), bf16);
  // Within the context (32): past it, each side's choice of what to keep differs.
  const auto ours_text = noloco::testing::run_cli("generate " + path("hf16") + " temperature=0 tokens=24 prompt=ROMEO:", 60);
  ASSERT_EQ(ours_text.exit_code, 0) << ours_text.output;
  const auto generated =
      run_ecosystem(fmt::format("generate {} --prompt ROMEO: --tokens 24 --out {}", path("hf16"), path("theirs.txt")));
  ASSERT_EQ(generated.exit_code, 0) << generated.output;
  const auto theirs_text = noloco::testing::read_text(path("theirs.txt"));
  EXPECT_GT(theirs_text.size(), std::string("ROMEO:").size() + 20);
  EXPECT_EQ(ours_text.output, theirs_text + "\n");
}

TEST_F(TrainedRun, SafetensorsOpensOurCheckpointsAndExports) {
  ExportOptions bf16;
  bf16.dtype = "bfloat16";
  export_hf(run(), path("hf_one"), bf16);
  for (const auto& file : {find_checkpoint(run()) + "/model.safetensors", path("hf_one") + "/model.safetensors"}) {
    SCOPED_TRACE(file);
    const auto read = run_ecosystem(fmt::format("read_safetensors {} --out {}", file, path("read.json")));
    ASSERT_EQ(read.exit_code, 0) << read.output;
    const auto theirs = read_json(path("read.json"))["tensors"];
    const auto ours = load_tensors(file);
    ASSERT_EQ(theirs.size(), ours.size());
    for (const auto& [name, t] : ours) {
      ASSERT_TRUE(theirs.contains(name)) << name;
      const auto& found = theirs[name];
      EXPECT_EQ(found["shape"].get<std::vector<int64_t>>(), t.sizes().vec()) << name;
      EXPECT_EQ(found["dtype"].get<std::string>(), t.scalar_type() == torch::kBFloat16 ? "bfloat16" : "float32") << name;
      EXPECT_DOUBLE_EQ(found["sum"].get<double>(), t.to(torch::kFloat64).sum().item<double>()) << name;
    }
  }
}

TEST_F(TrainedRun, TensorBoardReadsMetricsValuesFromOurEventFiles) {
  const auto read = run_ecosystem(fmt::format("read_events {}/tensorboard/replica_0 --out {}", run(), path("tb.json")));
  ASSERT_EQ(read.exit_code, 0) << read.output;
  const auto scalars = read_json(path("tb.json"))["scalars"];
  std::map<std::string, std::map<int64_t, double>> by_tag;
  for (const auto& [tag, points] : scalars.items())
    for (const auto& p : points) by_tag[tag][p[0].get<int64_t>()] = p[1].get<double>();
  const auto train = noloco::testing::metrics_records(run(), "train");
  const auto val = noloco::testing::metrics_records(run(), "val");
  ASSERT_EQ(train.size(), 400u);
  ASSERT_EQ(val.size(), 4u);
  ASSERT_EQ(by_tag["train/loss"].size(), train.size());
  for (const auto& r : train) {
    const auto step = r["step"].get<int64_t>();
    EXPECT_EQ(by_tag["train/loss"].at(step), double(float(r["loss"].get<double>()))) << step;
    EXPECT_EQ(by_tag["train/lr"].at(step), double(float(r["lr"].get<double>()))) << step;
  }
  ASSERT_EQ(by_tag["val/loss"].size(), val.size());
  for (const auto& r : val)
    EXPECT_EQ(by_tag["val/loss"].at(r["step"].get<int64_t>()), double(float(r["loss"].get<double>())));
}

// Texts a tokenizer meets: prose, accents, CJK, emoji (with joiners and
// modifiers), runs of spaces, tabs and newlines, digits, punctuation.
TEST(Ecosystem, TheTokenizersLibrarysByteLevelBpeGivesOurIds) {
  noloco::testing::TempDir dir;
  const std::vector<std::string> specials = {
      "café naïve Ångström façade", "日本語のテキストと中文的句子。", "한국어 문장입니다", "Привет, мир!",
      "👍🏽 🇫🇷 👨‍👩‍👧 ✨🎉", "a  b\t\tc\n\n\nd    e", "   leading and trailing   ", "12345 3.14159 2026-12-02",
      "don't won't it's we'll I'm", "x=1;y=2 # code\n\tif (a && b) { return; }", "\n", " ", "", "ÀÉÎÕÜ àéîõü ß ø"};
  std::string corpus = noloco::testing::shakespeare(20000);
  for (const auto& s : specials) corpus += "\n" + s;
  noloco::testing::write_text(dir / "corpus.txt", corpus);
  std::vector<std::string> texts = specials;
  const auto prose = noloco::testing::shakespeare(60000);
  for (size_t at = 0; texts.size() < 300; at += 197) {
    texts.push_back(prose.substr(at, 40 + at % 150));
    texts.push_back(specials[at % specials.size()] + prose.substr(at + 50, 30) + specials[(at / 3) % specials.size()]);
  }
  noloco::testing::write_text(dir / "texts.json", nlohmann::json(texts).dump());
  const auto trained = run_ecosystem(fmt::format("train_bpe {} --vocab 600 --out {}", dir / "corpus.txt",
                                                 dir / "tokenizer.json"));
  ASSERT_EQ(trained.exit_code, 0) << trained.output;
  const auto encoded = run_ecosystem(fmt::format("encode {} --texts {} --out {}", dir / "tokenizer.json",
                                                 dir / "texts.json", dir / "ids.json"));
  ASSERT_EQ(encoded.exit_code, 0) << encoded.output;
  const auto theirs = read_json(dir / "ids.json");
  const auto ours = load_byte_level_bpe(dir.path(), "tokenizer.json");
  ASSERT_EQ(theirs.size(), texts.size());
  size_t same = 0;
  for (size_t i = 0; i < texts.size(); ++i) {
    const auto ids = ours->encode(texts[i]);
    const auto expected = theirs[i].get<std::vector<int32_t>>();
    EXPECT_EQ(ids, expected) << "text " << i << ": " << nlohmann::json(texts[i]).dump();
    same += ids == expected;
    EXPECT_EQ(ours->decode(ids), texts[i]) << "text " << i;
  }
  std::printf("%zu of %zu texts tokenized as the tokenizers library does\n", same, texts.size());
  // Issue 103: what `prepare` leaves is a tokenizer.json the library reads, the file it came as.
  const auto prepared = noloco::testing::run_cli(
      "prepare " + dir / "corpus.txt" + " out=" + dir / "tokens" + " tokenizer=" + dir.path(), 120);
  ASSERT_EQ(prepared.exit_code, 0) << prepared.output;
  EXPECT_EQ(noloco::testing::read_text(dir / "tokens/tokenizer.json"), noloco::testing::read_text(dir / "tokenizer.json"));
  const auto from_prepared = run_ecosystem(fmt::format("encode {} --texts {} --out {}", dir / "tokens/tokenizer.json",
                                                       dir / "texts.json", dir / "prepared_ids.json"));
  ASSERT_EQ(from_prepared.exit_code, 0) << from_prepared.output;
  EXPECT_EQ(read_json(dir / "prepared_ids.json"), theirs);
}
