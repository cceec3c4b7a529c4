#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <tuple>
#include <thread>

#include <fmt/format.h>

#include "test_util.h"
#include "data/token_file.h"
#include "data/tokenizer.h"
#include "train/checkpoint.h"
#include "config/train_config.h"
#include "train/export.h"
#include "train/pace_record.h"
#include "train/run_directory.h"
#include "train/run_summary.h"
#include "train/trainer.h"
#include "util/crc32c.h"
#include "util/files.h"

using namespace noloco;
using noloco::testing::TempDir;

namespace {

std::vector<std::string> small_run(const std::string& data, const std::string& out) {
  return {"data=" + data, "out=" + out, "hidden=32", "layers=2", "heads=2", "intermediate=64",
          "context=32", "batch=4", "steps=20", "decay_steps=20", "warmup=4", "eval_interval=10",
          "eval_batches=2", "log_interval=1", "sample_tokens=0", "threads=1"};
}

std::map<int64_t, double> train_losses(const std::string& metrics_path) {
  std::map<int64_t, double> losses;
  std::istringstream in(noloco::testing::read_text(metrics_path));
  for (std::string line; std::getline(in, line);) {
    auto j = nlohmann::json::parse(line);
    if (j["split"] == "train") losses[j["step"].get<int64_t>()] = j["loss"].get<double>();
  }
  return losses;
}

// How many times each step was trained, over every life of the run in `run_dir`.
std::map<int64_t, int> times_trained(const std::string& run_dir) {
  std::map<int64_t, int> times;
  std::istringstream in(noloco::testing::read_text(run_dir + "/metrics.jsonl"));
  for (std::string line; std::getline(in, line);)
    if (auto j = nlohmann::json::parse(line); j["split"] == "train") ++times[j["step"].get<int64_t>()];
  return times;
}

Worker quiet() {
  Worker w;
  w.verbose = false;
  return w;
}

// A temporary directory holding a 20 kB corpus; runs train in-process, quietly.
class SmallRun : public ::testing::Test {
 protected:
  void SetUp() override { noloco::testing::write_text(dir / "c.txt", noloco::testing::shakespeare(20000)); }
  std::vector<std::string> args(const std::string& run, const std::vector<std::string>& extra = {}) {
    auto a = small_run(dir / "c.txt", dir / run);
    a.insert(a.end(), extra.begin(), extra.end());
    return a;
  }
  nlohmann::json train_run(const std::string& run, const std::vector<std::string>& extra = {}) {
    return train(parse_config("", args(run, extra)), quiet());
  }
  TempDir dir;
};
class Train : public SmallRun {};
class BadCheckpoint : public SmallRun {};
class Cli : public SmallRun {};

}  // namespace

TEST_F(Train, ResumeContinuesBitIdentically) {
  train_run("whole");
  train_run("split", {"steps=10"});
  const auto summary = train_run("split", {"resume=true"});

  const auto a = train_losses(dir / "whole/metrics.jsonl"), b = train_losses(dir / "split/metrics.jsonl");
  ASSERT_EQ(a.size(), 20u);
  ASSERT_EQ(b.size(), 20u);
  for (auto& [step, loss] : a) EXPECT_EQ(b.at(step), loss) << "step " << step;  // exact, not approximate
  const auto wa = load_tensors(dir / "whole/checkpoints/r0/step_00000020/model.safetensors");
  const auto wb = load_tensors(dir / "split/checkpoints/r0/step_00000020/model.safetensors");
  for (auto& [name, t] : wa) EXPECT_TRUE(torch::equal(t, wb.at(name))) << name;
  EXPECT_LT(summary["final_val_loss"].get<double>(), 4.0);
}

// Issue 48: the text's ids as llm.c shards (train in shards of 3000 tokens,
// validation beside them) train exactly as the text file does, and a run
// resumed across shards continues bit-identically.
TEST_F(Train, ShardSetsTrainAsTheirTextAndResumeBitIdentically) {
  const auto text = noloco::testing::shakespeare(20000);
  const auto tokenizer = make_char_tokenizer(text);
  const auto ids = tokenizer->encode(text);
  const size_t n_val = size_t(double(ids.size()) * 0.1);
  std::filesystem::create_directories(dir / "shards");
  for (const auto& [prefix, from, to] : {std::make_tuple("train", size_t(0), ids.size() - n_val),
                                         std::make_tuple("val", ids.size() - n_val, ids.size())}) {
    ShardWriter w(dir / "shards", prefix, 3000, false, tokenizer->vocab_size());
    w.append(ids, from, to - from);
    w.finish();
  }
  train_run("text");
  auto shards = [&](const std::string& run, const std::vector<std::string>& extra) {
    auto a = small_run(dir / "shards", dir / run);
    a.insert(a.end(), extra.begin(), extra.end());
    return train(parse_config("", a), quiet());
  };
  shards("whole", {});
  shards("split", {"steps=10"});
  shards("split", {"resume=true"});
  const auto text_losses = train_losses(dir / "text/metrics.jsonl");
  const auto a = train_losses(dir / "whole/metrics.jsonl"), b = train_losses(dir / "split/metrics.jsonl");
  ASSERT_EQ(a.size(), 20u);
  EXPECT_EQ(a, text_losses);  // exact: the same windows of the same ids
  EXPECT_EQ(b, a);
  const auto wa = load_tensors(dir / "whole/checkpoints/r0/step_00000020/model.safetensors");
  const auto wb = load_tensors(dir / "split/checkpoints/r0/step_00000020/model.safetensors");
  for (auto& [name, t] : wa) EXPECT_TRUE(torch::equal(t, wb.at(name))) << name;
}

TEST_F(Train, CheckpointExportAndHuggingFaceLayout) {
  const auto returned = train_run("run", {"steps=2"});
  const auto ckpt = find_checkpoint(dir / "run");
  ASSERT_FALSE(ckpt.empty());
  EXPECT_EQ(read_file(dir / "run/checkpoints/r0/latest"), "step_00000002\n");
  export_hf(dir / "run", dir / "hf");
  auto cfg = read_json(dir / "hf/config.json");
  EXPECT_EQ(cfg["model_type"], "llama");
  EXPECT_EQ(cfg["hidden_size"], 32);
  EXPECT_EQ(cfg["num_hidden_layers"], 2);
  EXPECT_EQ(cfg["intermediate_size"], 64);
  EXPECT_EQ(cfg["tie_word_embeddings"], false);
  std::map<std::string, std::string> meta;
  auto weights = load_tensors(dir / "hf/model.safetensors", &meta);
  EXPECT_EQ(meta["format"], "pt");
  EXPECT_EQ(weights.at("model.layers.1.mlp.down_proj.weight").sizes(), (std::vector<int64_t>{32, 64}));
  EXPECT_EQ(weights.at("lm_head.weight").size(0), cfg["vocab_size"].get<int64_t>());
  // The loop's own summary (the run's summary.json is the command's: Cli tests).
  const auto summary = read_json(dir / "run/summary_r0.json");
  EXPECT_EQ(summary, returned);
  for (auto key : {"final_val_loss", "steps", "tokens", "seconds", "params"}) EXPECT_TRUE(summary.contains(key)) << key;
  const auto line = noloco::testing::read_text(dir / "run/metrics.jsonl");
  auto first = nlohmann::json::parse(line.substr(0, line.find('\n')));
  for (auto key : {"step", "split", "loss", "lr", "tokens_per_s"}) EXPECT_TRUE(first.contains(key)) << key;
}

TEST_F(Train, KillDuringCheckpointWriteLeavesThePreviousOneLoadable) {
  std::string cli = "train configs/shakespeare.yaml";
  for (auto& a : args("run", {"steps=4", "checkpoint_interval=2"})) cli += " " + a;
  const auto killed = noloco::testing::run_cli(cli + " inject_crash=0:4:checkpoint", 60);
  EXPECT_EQ(killed.exit_code, 128 + 9) << killed.output;  // SIGKILL, halfway through step 4's checkpoint
  EXPECT_TRUE(std::filesystem::exists(dir / "run/checkpoints/r0/step_00000004.tmp/model.safetensors"));
  const auto found = find_checkpoint(dir / "run");
  EXPECT_NE(found.find("step_00000002"), std::string::npos) << found;
  EXPECT_NO_THROW(read_checkpoint(found, true));
  const auto resumed = noloco::testing::run_cli(cli + " resume=true", 60);
  EXPECT_EQ(resumed.exit_code, 0) << resumed.output;
  // Resumed from step 2: steps 3 and 4 were trained in both lives, 1 and 2 once.
  EXPECT_EQ(times_trained(dir / "run"), (std::map<int64_t, int>{{1, 1}, {2, 1}, {3, 2}, {4, 2}}));
  EXPECT_NE(find_checkpoint(dir / "run").find("step_00000004"), std::string::npos);
}

// ---- bad input through the command line: one line, non-zero exit ----

namespace {

void expect_one_line_error(const noloco::testing::CliResult& r, const std::string& needle) {
  EXPECT_NE(r.exit_code, 0) << r.output;
  auto last = r.output;
  while (!last.empty() && last.back() == '\n') last.pop_back();
  last = last.substr(last.rfind('\n') == std::string::npos ? 0 : last.rfind('\n') + 1);
  EXPECT_EQ(last.rfind("noloco: error: ", 0), 0u) << r.output;
  EXPECT_NE(last.find(needle), std::string::npos) << r.output;
}

}  // namespace

// pace=speed: the record of the slots a replica trained, one character a
// slot, gives a resume at step S what came after S, is rewritten from S on
// as training goes on (a jump to a live replica's step leaves '-'), and a
// record holding anything else is refused naming its file and slot.
TEST(PaceRecord, AResumeGetsWhatCameAfterItsStepAndABadRecordIsRefused) {
  TempDir dir;
  const auto path = dir / "r0/pace_slots";
  {
    PaceRecord record(path, 0, 100, true);
    EXPECT_TRUE(record.replay().empty());
    for (int64_t s = 0; s < 6; ++s) record.note(s, s % 3 != 1);
  }
  EXPECT_EQ(read_file(path), "101101");
  {
    PaceRecord resumed(path, 2, 100, true);
    EXPECT_EQ(resumed.replay(), (std::vector<bool>{true, true, false, true}));
    EXPECT_EQ(read_file(path), "10") << "written again as it trains";
    resumed.note(2, true);
    resumed.note(5, false);  // took a live replica's state at step 5
    EXPECT_EQ(read_file(path), "101--0");
  }
  write_file_atomic(path, "101101");
  EXPECT_EQ(PaceRecord(path, 3, 4, true).replay(), (std::vector<bool>{true})) << "no further than the run's steps";
  write_file_atomic(path, "101101");
  EXPECT_TRUE(PaceRecord(path, 2, 100, false).replay().empty()) << "a live replica's state replays nothing";
  EXPECT_EQ(read_file(path), "10");
  write_file_atomic(path, "10x1");
  try {
    PaceRecord bad(path, 0, 100, true);
    ADD_FAILURE() << "a record holding 'x' was read";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find(path + ": slot 2 holds byte 120"), std::string::npos) << e.what();
  }
}

TEST(BadInput, MissingDataFile) {
  expect_one_line_error(noloco::testing::run_cli("train configs/shakespeare.yaml data=/nonexistent/x.txt"),
                        "cannot open '/nonexistent/x.txt'");
}

// Issue 84: `noloco trian` said "A subcommand is required", `--steps=5` gave no hint.
TEST(BadInput, AMistypedCommandOrADashedKeySaysWhatWasMeant) {
  auto r = noloco::testing::run_cli("trian configs/shakespeare.yaml");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("unknown command 'trian' (did you mean train?)"), std::string::npos) << r.output;
  r = noloco::testing::run_cli("train configs/shakespeare.yaml --steps=5");
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("keys go as key=value, without dashes: steps=5"), std::string::npos) << r.output;
  r = noloco::testing::run_cli("train --help");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(r.output.find("keys go as"), std::string::npos) << r.output;
}

TEST(BadInput, EmptyDataFile) {
  TempDir dir;
  noloco::testing::write_text(dir / "empty.txt", "");
  expect_one_line_error(noloco::testing::run_cli("train configs/shakespeare.yaml out=" + dir.path() + "/r data=" + dir / "empty.txt"),
                        "is empty");
  EXPECT_FALSE(std::filesystem::exists(dir / "r")) << "a failed start left its run directory (and run.lock) behind";
}

// Issue 100 item 10: a tokenizer.json cut short, named as a file, was called
// an invalid sentencepiece model.
TEST(BadInput, ATruncatedTokenizerJsonIsCalledThat) {
  TempDir dir;
  noloco::testing::write_text(dir / "c.txt", noloco::testing::shakespeare(20000));
  noloco::testing::write_text(dir / "tokenizer.json", R"({"version": "1.0", "model": {"type": "BPE", "vocab": {"a")");
  expect_one_line_error(noloco::testing::run_cli("train configs/shakespeare.yaml steps=1 out=" + dir / "r" + " data=" +
                                                 dir / "c.txt" + " tokenizer=" + dir / "tokenizer.json"),
                        "tokenizer.json is not a tokenizer.json: not a JSON object (cut short?)");
}

TEST(BadInput, CorpusShorterThanOneBlock) {
  TempDir dir;
  noloco::testing::write_text(dir / "short.txt", noloco::testing::shakespeare(300));
  expect_one_line_error(noloco::testing::run_cli("train configs/shakespeare.yaml out=" + dir.path() + "/r data=" + dir / "short.txt"),
                        "too short");
}

TEST(BadInput, UnknownConfigKey) {
  expect_one_line_error(noloco::testing::run_cli("train configs/shakespeare.yaml learning_rate=3"),
                        "unknown config key 'learning_rate'");
}

TEST(BadInput, NegativeLearningRate) {
  expect_one_line_error(noloco::testing::run_cli("train configs/shakespeare.yaml lr=-1"), "lr must be >= 0");
}

TEST(BadInput, HeadsNotDividingHidden) {
  expect_one_line_error(noloco::testing::run_cli("train configs/shakespeare.yaml heads=3"), "must divide hidden");
}

// Issue 33: an id beyond the vocabulary in the validation file was found only
// at the first evaluation, in the workers; fragments beyond a worker's
// parameters failed in every worker. Both are refused before any worker starts.
TEST(BadInput, DataAndFragmentsAreCheckedBeforeAnyWorkerStarts) {
  TempDir dir;
  std::vector<int32_t> train(4000), val(400);
  for (size_t i = 0; i < train.size(); ++i) train[i] = int32_t(i % 64);
  for (size_t i = 0; i < val.size(); ++i) val[i] = int32_t(i % 64);
  val[123] = 64;
  write_token_file(dir / "train.bin", train);
  write_token_file(dir / "val.bin", val);
  const std::string data = " data=" + dir / "train.bin" + " val_data=" + dir / "val.bin" + " vocab_size=64";
  expect_one_line_error(noloco::testing::run_cli("train configs/shakespeare.yaml method=noloco replicas=2 out=" +
                                                 dir / "r1" + data),
                        "val.bin' holds token id 64 outside the vocabulary of 64");
  expect_one_line_error(noloco::testing::run_cli("train configs/shakespeare.yaml out=" + dir / "r2" + data),
                        "val.bin' holds token id 64 outside the vocabulary of 64");
  noloco::testing::write_text(dir / "c.txt", noloco::testing::shakespeare(20000));
  expect_one_line_error(
      noloco::testing::run_cli("train configs/shakespeare.yaml method=noloco replicas=2 hidden=8 layers=1 heads=1 "
                               "intermediate=8 outer_interval=100000 steps=100000 fragments=50000 out=" +
                               dir / "r3 data=" + dir / "c.txt"),
      "fragments=50000 exceeds the");
}

TEST(BadInput, MissingConfigFile) {
  expect_one_line_error(noloco::testing::run_cli("train configs/nope.yaml"), "cannot open 'configs/nope.yaml'");
}

TEST_F(BadCheckpoint, Truncated) {
  train_run("run", {"steps=1"});
  const auto ckpt = find_checkpoint(dir / "run");
  auto bytes = noloco::testing::read_text(ckpt + "/model.safetensors");
  noloco::testing::write_text(ckpt + "/model.safetensors", bytes.substr(0, bytes.size() / 2));
  expect_one_line_error(noloco::testing::run_cli("generate " + ckpt + " tokens=5"), "model.safetensors is corrupt");
}

TEST_F(BadCheckpoint, OfAnotherModelShape) {
  train_run("run", {"steps=1"});
  std::string cli = "train configs/shakespeare.yaml";
  for (auto& a : args("run", {"steps=1"})) cli += " " + a;
  expect_one_line_error(noloco::testing::run_cli(cli + " hidden=64 resume=true"), "does not match the config");
}

// Issue 100 item 10: an export that fails part way (here: a file-size limit
// standing in for a full disk) leaves no partial directory, and an earlier
// export in the same place as it was.
TEST_F(BadCheckpoint, AnExportThatFailsLeavesNoPartialModelAndTheEarlierExportWhole) {
  train_run("run", {"steps=1"});
  const std::string full_disk = "trap '' XFSZ; ulimit -f 16;";  // EFBIG past 8 KiB instead of a signal
  expect_one_line_error(noloco::testing::run_cli("export " + dir / "run" + " " + dir / "hf", 60, full_disk), "");
  EXPECT_FALSE(std::filesystem::exists(dir / "hf"));
  const auto ok = noloco::testing::run_cli("export " + dir / "run" + " " + dir / "hf", 60);
  ASSERT_EQ(ok.exit_code, 0) << ok.output;
  const auto before = noloco::testing::read_text(dir / "hf/model.safetensors");
  expect_one_line_error(noloco::testing::run_cli("export " + dir / "run" + " " + dir / "hf" + " dtype=bfloat16", 60, full_disk),
                        "");
  EXPECT_EQ(noloco::testing::read_text(dir / "hf/model.safetensors"), before);
  EXPECT_TRUE(std::filesystem::exists(dir / "hf/config.json"));
  for (const auto& entry : std::filesystem::directory_iterator(dir.path()))
    EXPECT_EQ(entry.path().filename().string().find(".partial-"), std::string::npos) << entry.path();
}

// Issue 84: export and generate take the mean of a run's replicas or the
// replica named; issue 101: by default the one summary.json says the run's
// validation found best (the mean where it validated at least as well as the
// best replica).
TEST_F(Cli, ExportAndGenerateTakeTheBestModelTheMeanOfTheReplicasOrTheOneNamed) {
  std::string cli = "train configs/shakespeare.yaml";
  for (auto& a : args("run", {"steps=5", "method=noloco", "replicas=2", "outer_interval=3", "batch=2"})) cli += " " + a;
  const auto trained = noloco::testing::run_cli(cli, 120);
  ASSERT_EQ(trained.exit_code, 0) << trained.output;
  std::map<std::string, TensorMap> exported;
  for (const std::string replica : {"mean", "0", "1"}) {
    const auto r = noloco::testing::run_cli("export " + dir / "run" + " " + dir / ("hf_" + replica) + " replica=" + replica);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find(replica == "mean" ? "(the mean of its replicas)" : "(replica " + replica + ")"),
              std::string::npos) << r.output;
    exported[replica] = load_tensors(dir / ("hf_" + replica) + "/model.safetensors");
  }
  const auto default_export = noloco::testing::run_cli("export " + dir / "run" + " " + dir / "hf_default");
  ASSERT_EQ(default_export.exit_code, 0) << default_export.output;
  const auto summary = RunSummary::read(dir / "run");
  ASSERT_TRUE(summary.final_val_loss_mean_model && summary.best_replica) << "nothing to choose by: the test checks nothing";
  const bool mean_chosen = summary.handed_over == "mean";
  const double best = *summary.final_val_loss_best_replica;
  EXPECT_EQ(mean_chosen, *summary.final_val_loss_mean_model <= best + kLossRounding * std::abs(best));
  EXPECT_NE(default_export.output.find(mean_chosen ? "(the mean of its replicas: validation loss"
                                                   : "(" + summary.handed_over + ": validation loss"),
            std::string::npos)
      << default_export.output;
  const auto by_default = load_tensors(dir / "hf_default/model.safetensors");
  const auto& chosen = exported[mean_chosen ? "mean" : std::to_string(*summary.best_replica)];
  const auto r0_checkpoint = load_tensors(dir / "run/checkpoints/r0/step_00000005/model.safetensors");
  bool replicas_differ = false;
  for (const auto& [name, mean] : exported["mean"]) {
    const auto &a = exported["0"].at(name), &b = exported["1"].at(name);
    EXPECT_TRUE(torch::allclose(mean, (a + b) / 2, 1e-6, 1e-7)) << name;
    EXPECT_TRUE(torch::equal(by_default.at(name), chosen.at(name))) << name;
    EXPECT_TRUE(torch::equal(a, r0_checkpoint.at(name))) << name;
    replicas_differ = replicas_differ || !torch::equal(a, b);
  }
  EXPECT_TRUE(replicas_differ) << "the two replicas ended equal: the mean checks nothing";
  const auto sampled = noloco::testing::run_cli("generate " + dir / "run" + " replica=mean tokens=5 seed=1");
  EXPECT_EQ(sampled.exit_code, 0) << sampled.output;
  expect_one_line_error(noloco::testing::run_cli("generate " + dir / "run" + " replica=7 tokens=5"),
                        "holds checkpoints of replicas 0, 1");
}

TEST_F(Cli, ARunWithoutValidationTrainsAndHandsOverTheMeanOfItsReplicas) {
  std::string cli = "train";
  for (auto& a : args("run", {"steps=6", "method=noloco", "replicas=2", "outer_interval=3", "batch=2",
                              "eval_interval=3", "val_fraction=0"}))
    cli += " " + a;
  const auto trained = noloco::testing::run_cli(cli, 120);
  ASSERT_EQ(trained.exit_code, 0) << trained.output;
  const auto summary = RunSummary::read(dir / "run");
  EXPECT_FALSE(summary.final_val_loss);
  EXPECT_FALSE(summary.final_val_loss_mean_model);
  EXPECT_FALSE(summary.best_replica);
  EXPECT_EQ(summary.handed_over, "mean");
  int evaluations = 0;
  std::istringstream metrics(noloco::testing::read_text(dir / "run/metrics.jsonl"));
  for (std::string line; std::getline(metrics, line);) {
    const auto r = nlohmann::json::parse(line);
    if (r["split"] == "val") {
      ++evaluations;
      EXPECT_FALSE(r.contains("loss")) << line;
      EXPECT_TRUE(r.contains("weight_std")) << "the spread is measured all the same: " << line;
    }
  }
  EXPECT_EQ(evaluations, 4) << "two evaluations of each of the two replicas";
  const auto exported = noloco::testing::run_cli("export " + dir / "run" + " " + dir / "hf");
  ASSERT_EQ(exported.exit_code, 0) << exported.output;
  const auto mean = load_tensors(dir / "hf/model.safetensors");
  const auto a = load_tensors(dir / "run/checkpoints/r0/step_00000006/model.safetensors"),
             b = load_tensors(dir / "run/checkpoints/r1/step_00000006/model.safetensors");
  for (const auto& [name, m] : mean) EXPECT_TRUE(torch::allclose(m, (a.at(name) + b.at(name)) / 2, 1e-6, 1e-7)) << name;
}

TEST_F(Cli, GenerateFromARunDirectory) {
  train_run("run", {"steps=1"});
  auto r = noloco::testing::run_cli("generate " + dir / "run" + " prompt=ROMEO tokens=20 seed=3 temperature=1.0");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(r.output.rfind("ROMEO", 0), 0u) << r.output;
  EXPECT_EQ(r.output.size(), 5u + 20u + 1u);  // char model: one character per token, then newline
  EXPECT_EQ(noloco::testing::run_cli("generate " + dir / "run" + " prompt=ROMEO tokens=20 seed=3 temperature=1.0").output,
            r.output);  // seeded
}

// ---- checkpoints and run directories under careless or hostile use (issue 12) ----

// Issue 33: a worker killed (or out of disk) while writing its first
// checkpoint leaves only step_N.tmp, which was never a checkpoint; resume used
// to be refused for good. It starts afresh.
TEST_F(BadCheckpoint, AnUnfinishedFirstCheckpointDoesNotBlockResume) {
  std::string cli = "train configs/shakespeare.yaml";
  for (auto& a : args("run", {"steps=4", "checkpoint_interval=2"})) cli += " " + a;
  const auto killed = noloco::testing::run_cli(cli + " inject_crash=0:2:checkpoint", 60);
  ASSERT_EQ(killed.exit_code, 128 + 9) << killed.output;
  ASSERT_TRUE(std::filesystem::exists(dir / "run/checkpoints/r0/step_00000002.tmp"));
  const auto resumed = noloco::testing::run_cli(cli + " resume=true", 60);
  EXPECT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_NE(resumed.output.find("holds no checkpoint; starting from scratch"), std::string::npos) << resumed.output;
  EXPECT_TRUE(std::filesystem::exists(dir / "run/checkpoints/r0/step_00000004/checksums.json"));
}

TEST_F(BadCheckpoint, ResumeWithoutLatestTakesTheNewestCompleteCheckpoint) {
  train_run("run", {"steps=4", "checkpoint_interval=2"});
  std::filesystem::remove(dir / "run/checkpoints/r0/latest");
  const auto before = std::filesystem::last_write_time(dir / "run/checkpoints/r0/step_00000004/model.safetensors");
  std::string cli = "train configs/shakespeare.yaml";
  for (auto& a : args("run", {"steps=6", "checkpoint_interval=2", "decay_steps=20"})) cli += " " + a;
  const auto r = noloco::testing::run_cli(cli + " resume=true", 60);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(times_trained(dir / "run"), (std::map<int64_t, int>{{1, 1}, {2, 1}, {3, 1}, {4, 1}, {5, 1}, {6, 1}}))
      << "resumed from step 4, not from scratch";
  EXPECT_EQ(std::filesystem::last_write_time(dir / "run/checkpoints/r0/step_00000004/model.safetensors"), before);
  EXPECT_TRUE(std::filesystem::exists(dir / "run/checkpoints/r0/step_00000006/checksums.json"));
}

TEST_F(BadCheckpoint, ANewRunNeverOverwritesAnotherOrTakesItsDirectory) {
  train_run("run", {"steps=2"});
  const auto before = noloco::testing::read_text(dir / "run/checkpoints/r0/step_00000002/model.safetensors");
  std::string cli = "train configs/shakespeare.yaml";
  for (auto& a : args("run", {"steps=2"})) cli += " " + a;
  expect_one_line_error(noloco::testing::run_cli(cli + " hidden=64"), "already holds a run");
  EXPECT_EQ(noloco::testing::read_text(dir / "run/checkpoints/r0/step_00000002/model.safetensors"), before);
  Checkpoint again;
  EXPECT_THROW(write_checkpoint(dir / "run/checkpoints/r0", 2, again, dir / "run"), std::runtime_error);
}

// Issue 84: a mistyped out= with resume=true started a new run and exited 0.
TEST_F(BadCheckpoint, AResumeOfADirectoryWithoutARunIsRefusedAndLeavesNothing) {
  for (const std::string launched : {"", " method=noloco replicas=2"}) {
    std::string cli = "train configs/shakespeare.yaml";
    for (auto& a : args("typo", {"steps=2"})) cli += " " + a;
    expect_one_line_error(noloco::testing::run_cli(cli + launched + " resume=true", 60), "holds no run to continue");
    EXPECT_FALSE(std::filesystem::exists(dir / "typo"));
  }
  // A launcher whose start fails after taking the directory leaves nothing either.
  noloco::testing::write_text(dir / "empty.txt", "");
  std::string cli = "train configs/shakespeare.yaml";
  for (auto& a : args("failed", {"steps=2", "method=noloco", "replicas=2"})) cli += " " + a;
  expect_one_line_error(noloco::testing::run_cli(cli + " data=" + dir / "empty.txt", 60), "is empty");
  EXPECT_FALSE(std::filesystem::exists(dir / "failed"));
}

TEST_F(BadCheckpoint, TwoRunsCannotShareADirectory) {
  std::string cli = "train configs/shakespeare.yaml";
  for (auto& a : args("run", {"steps=100000", "eval_interval=100000"})) cli += " " + a;
  noloco::testing::BackgroundCli runner(cli, 60);
  for (int i = 0; i < 300 && !std::filesystem::exists(dir / "run/metrics.jsonl"); ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  const auto second = noloco::testing::run_cli(cli + " resume=true", 30);
  EXPECT_EQ(::system(("pkill -INT -f '[n]oloco train .*out=" + dir / "run" + " '").c_str()), 0);
  const auto& first = runner.wait();
  expect_one_line_error(second, "is in use by another run (pid ");
}

// Issue 100 item 6: a launched run started in the directory of a running
// plain-env pair wrote into its metrics and checkpoints. The pair's workers
// hold the directory together; a launched run is refused there, and they in
// a launched run's.
TEST(RunDirectoryLock, WorkersOfARunStartedWithoutTheLauncherShareItAndALaunchedRunIsRefused) {
  TempDir dir;
  const auto config = parse_config("", {});
  const auto out = dir / "pair";
  {
    RunDirectory first(out, config, RunDirectory::Hold::worker), second(out, config, RunDirectory::Hold::worker);
    try {
      RunDirectory launched(out, config);
      ADD_FAILURE() << "a launched run took a directory its workers hold";
    } catch (const std::runtime_error& e) {
      EXPECT_NE(std::string(e.what()).find("is in use by another run (workers started without noloco's launcher)"),
                std::string::npos)
          << e.what();
    }
  }
  {
    RunDirectory launched(out, config);
    EXPECT_THROW(RunDirectory(out, config, RunDirectory::Hold::worker), std::runtime_error);
  }
  RunDirectory after(out, config, RunDirectory::Hold::worker);  // each let go: taken again
}

TEST_F(BadCheckpoint, FlippedBytesInsideATensorAreCaughtOnEveryLoad) {
  const auto returned = train_run("run", {"steps=2"});
  const auto ckpt = find_checkpoint(dir / "run");
  auto bytes = noloco::testing::read_text(ckpt + "/model.safetensors");
  for (size_t i = bytes.size() - 200; i < bytes.size() - 100; ++i) bytes[i] = char(~bytes[i]);  // tensor data, not the header
  noloco::testing::write_text(ckpt + "/model.safetensors", bytes);
  std::string cli = "train configs/shakespeare.yaml";
  for (auto& a : args("run", {"steps=4"})) cli += " " + a;
  for (const auto& command : {cli + " resume=true", "export " + dir / "run" + " " + dir / "hf",
                              "generate " + dir / "run" + " tokens=3"})
    expect_one_line_error(noloco::testing::run_cli(command, 60), "step_00000002/model.safetensors is corrupt");
}

TEST_F(BadCheckpoint, EveryStateFieldIsChecked) {
  const auto returned = train_run("run", {"steps=2"});
  const auto ckpt = find_checkpoint(dir / "run");
  auto info = read_json(ckpt + "/state.json");
  std::string cli = "train configs/shakespeare.yaml";
  for (auto& a : args("run", {"steps=4"})) cli += " " + a;
  auto with = [&](const char* key, nlohmann::json value) {
    auto changed = info;
    changed[key] = value;
    write_json_atomic(ckpt + "/state.json", changed);
    // Record the new file's checksum: what is under test is the field, not the CRC.
    auto sums = read_json(ckpt + "/checksums.json");
    sums["files"]["state.json"] = fmt::format("{:08x}", crc32c(noloco::testing::read_text(ckpt + "/state.json")));
    write_json_atomic(ckpt + "/checksums.json", sums);
    return noloco::testing::run_cli(cli + " resume=true", 60);
  };
  expect_one_line_error(with("step", -7), "'step' must be in [0,");
  expect_one_line_error(with("step", 1000000000), "past steps=4");
  expect_one_line_error(with("step", "2"), "'step' must be an integer");
  expect_one_line_error(with("adam_steps", 5), "'adam_steps' must be in [0, 2]");
  expect_one_line_error(with("replica", 3), "'replica' must be in [0, 0]");
}

TEST_F(Train, KeepsOnlyTheNewestCheckpointsWhenAsked) {
  train_run("run", {"steps=10", "checkpoint_interval=2", "keep_checkpoints=2"});
  std::vector<std::string> left;
  for (auto& e : std::filesystem::directory_iterator(dir / "run/checkpoints/r0"))
    if (e.is_directory()) left.push_back(e.path().filename().string());
  std::sort(left.begin(), left.end());
  EXPECT_EQ(left, (std::vector<std::string>{"step_00000008", "step_00000010"}));
}

TEST_F(Cli, GenerateHasABoundOnTokens) {
  train_run("run", {"steps=1"});
  expect_one_line_error(noloco::testing::run_cli("generate " + dir / "run" + " tokens=100000000000"), "tokens in [0, 1000000]");
}
