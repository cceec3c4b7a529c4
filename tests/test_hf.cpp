// Hugging Face directories: export -> import round trips (exact logits),
// sharding and its index, bf16 files, tied embeddings, the errors a malformed
// directory gets, init_from in the config and in a run, and `prepare`.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>

#include <fmt/format.h>

#include "config/train_config.h"
#include "data/prepare.h"
#include "data/token_file.h"
#include "data/tokenizer.h"
#include "model/hf_directory.h"
#include "test_util.h"
#include "tokenizer_fixtures.h"
#include "train/checkpoint.h"
#include "train/export.h"
#include "train/trainer.h"
#include "util/files.h"
#include "util/parse_number.h"
#include "util/safetensors_index.h"

using namespace noloco;
using noloco::testing::TempDir;
using noloco::testing::error_of;
namespace fs = std::filesystem;

namespace {

ModelConfig small_model(int64_t kv_heads) {
  ModelConfig c;
  c.vocab_size = 37;
  c.hidden = 32;
  c.layers = 3;
  c.heads = 4;
  c.kv_heads = kv_heads;
  c.intermediate = 48;
  c.context = 16;
  return c;
}

TensorMap weights_of(LlamaForCausalLM& model) {
  TensorMap out;
  for (auto& p : model->named_parameters()) out[p.key()] = p.value().detach().clone();
  return out;
}

// A model directory as `export` writes it, from a freshly initialised model.
void write_directory(const std::string& dir, LlamaForCausalLM& model, uint64_t shard_bytes = uint64_t(1) << 30,
                     torch::ScalarType dtype = torch::kFloat32) {
  write_hf_weights(dir, weights_of(model), shard_bytes, dtype);
  write_json_atomic(dir + "/config.json", model->config.to_hf_json());
}

torch::Tensor logits(LlamaForCausalLM& model) {
  torch::NoGradGuard g;
  return model->forward(torch::tensor({{1, 5, 2, 9, 3, 7, 30, 36}, {4, 4, 0, 10, 7, 2, 11, 12}}, torch::kInt64));
}

LlamaForCausalLM imported(const std::string& dir) {
  LlamaForCausalLM model(read_hf_config(dir));
  load_hf_weights(model, dir);
  return model;
}

}  // namespace

TEST(HfDirectory, ExportThenImportGivesIdenticalLogits) {
  for (int64_t kv : {0, 2}) {
    for (uint64_t shard : {uint64_t(1) << 30, uint64_t(20000)}) {
      TempDir dir;
      auto c = small_model(kv);
      LlamaForCausalLM model(c);
      init_weights(model, 3);
      write_directory(dir.path(), model, shard);
      const bool sharded = shard < (1 << 20);
      EXPECT_EQ(fs::exists(dir / "model.safetensors.index.json"), sharded);
      EXPECT_EQ(fs::exists(dir / "model.safetensors"), !sharded);
      auto back = imported(dir.path());
      EXPECT_EQ(back->config.key_value_heads(), c.key_value_heads());
      EXPECT_TRUE(torch::equal(logits(model), logits(back))) << "kv_heads " << kv << " shard " << shard;
      if (sharded) {
        const auto index = parse_safetensors_index(read_file(dir / "model.safetensors.index.json"));
        EXPECT_GT(index.files().size(), 2u);
        for (const auto& f : index.files()) EXPECT_LE(fs::file_size(dir / f), 20000u + 4096u) << f;
        EXPECT_EQ(index.files().front(), shard_file_name(0, index.files().size()));
        EXPECT_EQ(read_json(dir / "model.safetensors.index.json")["metadata"]["total_size"].get<int64_t>(),
                  c.num_params() * 4);
      }
      EXPECT_EQ(read_json(dir / "config.json")["num_key_value_heads"].get<int64_t>(), c.key_value_heads());
    }
  }
}

TEST(HfDirectory, Bf16FilesImportAsTheirFp32Values) {
  TempDir dir;
  LlamaForCausalLM model(small_model(2));
  init_weights(model, 5);
  write_directory(dir.path(), model, uint64_t(1) << 30, torch::kBFloat16);
  EXPECT_EQ(load_tensors(dir / "model.safetensors").at("lm_head.weight").scalar_type(), torch::kBFloat16);
  auto back = imported(dir.path());
  {
    torch::NoGradGuard g;
    for (auto& p : model->parameters()) p.copy_(p.to(torch::kBFloat16).to(torch::kFloat32));
  }
  for (auto& p : back->named_parameters()) EXPECT_EQ(p.value().scalar_type(), torch::kFloat32);
  EXPECT_TRUE(torch::equal(logits(model), logits(back)));
}

// A tied directory (tie_word_embeddings, no lm_head.weight, or one that
// repeats the embeddings) is read as a tied model; a run that unties it gets a
// copy of the embeddings as its head; an untied one without a head is refused.
TEST(HfDirectory, TiedEmbeddingsStayTiedUnlessARunUntiesThem) {
  TempDir dir;
  auto shape = small_model(0);
  shape.tied_embeddings = true;
  LlamaForCausalLM model(shape);
  init_weights(model, 5);
  write_directory(dir.path(), model);
  EXPECT_FALSE(load_tensors(dir / "model.safetensors").count("lm_head.weight"));
  EXPECT_EQ(read_json(dir / "config.json")["tie_word_embeddings"], true);
  auto back = imported(dir.path());
  EXPECT_TRUE(back->config.tied_embeddings);
  EXPECT_FALSE(back->lm_head);
  EXPECT_TRUE(torch::equal(logits(back), logits(model)));
  {
    torch::NoGradGuard g;  // the head is the embedding matrix: changing one changes the logits
    back->model->embed_tokens->weight.index({36}).add_(1.0);
  }
  EXPECT_FALSE(torch::equal(logits(back), logits(model)));

  auto untied = read_hf_config(dir.path());
  untied.tied_embeddings = false;
  EXPECT_TRUE(torch::equal(read_hf_weights(dir.path(), untied).at("lm_head.weight"),
                           model->model->embed_tokens->weight));

  auto weights = weights_of(model);
  weights["lm_head.weight"] = weights.at("model.embed_tokens.weight");
  write_hf_weights(dir.path(), weights, uint64_t(1) << 30, torch::kFloat32);
  auto repeated = imported(dir.path());
  EXPECT_TRUE(torch::equal(logits(repeated), logits(model)));

  weights.erase("lm_head.weight");
  write_hf_weights(dir.path(), weights, uint64_t(1) << 30, torch::kFloat32);
  auto config = read_json(dir / "config.json");
  config["tie_word_embeddings"] = false;
  write_json_atomic(dir / "config.json", config);
  EXPECT_NE(error_of([&] { imported(dir.path()); }).find("no tensor 'lm_head.weight'"), std::string::npos);
}

TEST(HfDirectory, MalformedDirectoriesAreNamedInOneLine) {
  TempDir dir;
  LlamaForCausalLM model(small_model(2));
  init_weights(model, 5);
  const auto d = dir.path();
  auto expect_error = [&](const std::string& needle) {
    const auto e = error_of([&] { imported(d); });
    EXPECT_NE(e.find(needle), std::string::npos) << e;
    EXPECT_EQ(e.find('\n'), std::string::npos) << e;
  };
  write_directory(d, model, 20000);
  const auto index_path = dir / "model.safetensors.index.json";
  const auto index_text = read_file(index_path);
  const auto index = parse_safetensors_index(index_text);
  const auto last = index.files().back();

  fs::rename(dir / last, dir / "moved");
  expect_error(fmt::format("shard {} listed in model.safetensors.index.json is missing", last));
  fs::rename(dir / "moved", dir / last);

  // A tensor in two shards.
  const auto first = index.files().front();
  auto extra = load_tensors(dir / last);
  extra.insert(*load_tensors(dir / first).begin());
  save_tensors(dir / last, extra);
  expect_error("is in both");
  write_directory(d, model, 20000);

  // A tensor in another shard than the index says.
  auto moved = nlohmann::json::parse(index_text);
  const auto name = index.weight_map.begin()->first;
  moved["weight_map"][name] = index.weight_map.at(name) == first ? last : first;
  write_file_atomic(index_path, moved.dump());
  expect_error("which model.safetensors.index.json places in");

  // An index that points outside the directory.
  moved["weight_map"][name] = "../elsewhere.safetensors";
  write_file_atomic(index_path, moved.dump());
  expect_error("must be a *.safetensors name in the same directory");
  write_file_atomic(index_path, "{\"weight_map\": [1, 2]}");
  expect_error("'weight_map' must be an object");
  write_file_atomic(index_path, "not json");
  expect_error("not valid JSON");
  write_directory(d, model, 20000);

  // Shapes that do not match the config.
  auto config = model->config.to_hf_json();
  config["intermediate_size"] = 64;
  write_json_atomic(dir / "config.json", config);
  expect_error("'model.layers.0.mlp.gate_proj.weight' has shape [48, 32], config.json implies [64, 32]");
  config["intermediate_size"] = 48;
  config["num_key_value_heads"] = 4;
  write_json_atomic(dir / "config.json", config);
  expect_error("'model.layers.0.self_attn.k_proj.weight' has shape [16, 32], config.json implies [32, 32]");

  // Configs this model does not implement.
  auto refused = [&](const char* key, nlohmann::json value, const std::string& needle) {
    auto bad = model->config.to_hf_json();
    bad[key] = value;
    write_json_atomic(dir / "config.json", bad);
    expect_error(needle);
  };
  refused("rope_scaling", {{"rope_type", "yarn"}, {"factor", 8.0}}, "rope_scaling type 'yarn' is not implemented");
  refused("rope_scaling", {{"rope_type", "llama3"}, {"factor", 8.0}}, "rope_scaling llama3 needs a number 'low_freq_factor'");
  refused("attention_bias", true, "'attention_bias' is true: attention biases are not implemented");
  refused("architectures", {"MistralForCausalLM"}, "only LlamaForCausalLM is supported");
  refused("hidden_act", "gelu", "'hidden_act' is \"gelu\"");
  refused("hidden_size", "32", "'hidden_size' must be an integer");
  refused("num_key_value_heads", 3, "kv_heads (3) must divide heads (4)");
  auto no_hidden = model->config.to_hf_json();
  no_hidden.erase("hidden_size");
  write_json_atomic(dir / "config.json", no_hidden);
  expect_error("config.json has no 'hidden_size'");
}

TEST(HfDirectory, ShardPlanAndSizes) {
  EXPECT_EQ(plan_shards({10, 10, 10, 25, 5}, 20), (std::vector<std::vector<size_t>>{{0, 1}, {2}, {3}, {4}}));
  EXPECT_EQ(plan_shards({10, 10}, 100), (std::vector<std::vector<size_t>>{{0, 1}}));
  EXPECT_EQ(shard_file_name(0, 3), "model-00001-of-00003.safetensors");
  EXPECT_EQ(parse_byte_size("shard_size", "2GB"), 2000000000u);
  EXPECT_EQ(parse_byte_size("shard_size", "4GiB"), 4294967296u);
  EXPECT_EQ(parse_byte_size("shard_size", "1500"), 1500u);
  EXPECT_THROW(parse_byte_size("shard_size", "2 GB"), std::invalid_argument);
  EXPECT_THROW(parse_byte_size("shard_size", "0MB"), std::invalid_argument);
}

namespace {

class HfRun : public ::testing::Test {
 protected:
  void SetUp() override { noloco::testing::write_text(dir / "c.txt", noloco::testing::shakespeare(20000)); }
  nlohmann::json train_run(const std::string& run, std::vector<std::string> extra) {
    std::vector<std::string> a = {"data=" + (dir / "c.txt"), "out=" + (dir / run), "batch=4", "warmup=0",
                                  "eval_interval=5", "eval_batches=2", "sample_tokens=0", "threads=1"};
    a.insert(a.end(), extra.begin(), extra.end());
    Worker quiet;
    quiet.verbose = false;
    return train(parse_config("", a), quiet);
  }
  TempDir dir;
};

}  // namespace

// The whole path a user takes: train, export sharded in bf16 and fp32, then
// generate from the directory, and start a new run from it.
TEST_F(HfRun, ExportedRunImportsIntoGenerateAndInitFrom) {
  const std::vector<std::string> shape = {"hidden=32", "layers=2", "heads=4", "kv_heads=2", "intermediate=64",
                                          "context=32"};
  auto first = shape;
  first.insert(first.end(), {"steps=10", "decay_steps=10"});
  train_run("a", first);
  ExportOptions o;
  o.shard_bytes = 30000;
  export_hf(dir / "a", dir / "hf", o);
  EXPECT_TRUE(fs::exists(dir / "hf/model.safetensors.index.json"));
  EXPECT_TRUE(fs::exists(dir / "hf/noloco_tokenizer.json"));
  const auto hf_tokenizer = read_json(dir / "hf/tokenizer.json");
  EXPECT_EQ(hf_tokenizer["model"]["type"], "BPE");
  EXPECT_EQ(hf_tokenizer["model"]["vocab"].size(), load_tokenizer(dir / "a")->vocab_size());
  EXPECT_EQ(hf_tokenizer["model"]["vocab"]["Ġ"], load_tokenizer(dir / "a")->encode(" ")[0]);  // GPT-2's byte map

  // generate from the HF directory == generate from the run.
  const auto from_run = noloco::testing::run_cli("generate " + (dir / "a") + " tokens=20 prompt=ROMEO", 60);
  const auto from_hf = noloco::testing::run_cli("generate " + (dir / "hf") + " tokens=20 prompt=ROMEO", 60);
  ASSERT_EQ(from_run.exit_code, 0) << from_run.output;
  ASSERT_EQ(from_hf.exit_code, 0) << from_hf.output;
  EXPECT_EQ(from_run.output, from_hf.output);

  // init_from: the shape, tokenizer and weights come from the directory.
  const auto cfg = parse_config("", {"init_from=" + (dir / "hf"), "context=16"});
  EXPECT_EQ(cfg.model.kv_heads, 2);
  EXPECT_EQ(cfg.model.hidden, 32);
  EXPECT_EQ(cfg.model.context, 16);
  EXPECT_EQ(cfg.data.model_dir, dir / "hf");  // its tokenizer, when the corpus is read
  EXPECT_NE(error_of([&] { parse_config("", {"init_from=" + (dir / "hf"), "hidden=64"}); })
                .find("hidden=64 disagrees with init_from"),
            std::string::npos);
  // Issue 103: a config file written for another model continues this one:
  // its model and tokenizer keys yield, its longer context is cut to the
  // model's positions; the command line's still must agree.
  const auto yaml = read_file(NOLOCO_SOURCE_DIR "/configs/shakespeare.yaml");
  const auto continued = parse_config(yaml, {"init_from=" + (dir / "hf")});
  EXPECT_EQ(continued.model.hidden, 32);
  EXPECT_EQ(continued.model.layers, 2);
  EXPECT_EQ(continued.model.context, 32) << "the YAML's 64 cut to the model's 32 positions";
  EXPECT_EQ(continued.data.model_dir, dir / "hf") << "the model's tokenizer, not the YAML's char";
  EXPECT_EQ(continued.inner.lr, 1e-3) << "the YAML's training keys stay";
  EXPECT_NE(error_of([&] { parse_config(yaml, {"init_from=" + (dir / "hf"), "layers=4"}); })
                .find("layers=4 disagrees with init_from"),
            std::string::npos);
  EXPECT_NE(error_of([&] { parse_config(yaml, {"init_from=" + (dir / "hf"), "model=tiny"}); })
                .find("name two models"),
            std::string::npos);
  EXPECT_NE(error_of([&] { parse_config("", {"init_from=" + (dir / "hf"), "context=64"}); })
                .find("exceeds init_from"),
            std::string::npos);
  EXPECT_NE(error_of([&] { parse_config("", {"init_from=" + (dir / "hf"), "head_dim=16"}); })
                .find("head_dim=16 disagrees with init_from"),
            std::string::npos);
  EXPECT_NE(error_of([&] { parse_config("", {"init_from=" + (dir / "hf"), "tie_embeddings=true"}); })
                .find("has an lm_head of its own"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              parse_config("", {"init_from=" + (dir / "hf"), "stages=2", "activation_subspace=8",
                                "activation_subspace_token_std=1"});
            }).find("activation_subspace_token_std with init_from"),
            std::string::npos);
  EXPECT_NE(error_of([&] { parse_config("", {"tie_embeddings=true", "stages=2"}); })
                .find("tie_embeddings with stages > 1 is not implemented"),
            std::string::npos);
  // With a vanishing learning rate one step leaves the imported weights in place.
  train_run("b", {"init_from=" + (dir / "hf"), "steps=1", "lr=1e-20", "min_lr=0"});
  EXPECT_EQ(load_tokenizer(dir / "b")->encode("ROMEO: the"), load_tokenizer(dir / "hf")->encode("ROMEO: the"));
  const auto trained = load_tensors(find_checkpoint(dir / "a") + "/model.safetensors");
  const auto resumed = load_tensors(find_checkpoint(dir / "b") + "/model.safetensors");
  ASSERT_EQ(trained.size(), resumed.size());
  for (const auto& [name, t] : trained) EXPECT_TRUE(torch::allclose(t, resumed.at(name), 0, 1e-12)) << name;

  // bf16 export, unsharded by default.
  o = ExportOptions{};
  o.dtype = "bfloat16";
  export_hf(dir / "a", dir / "hf", o);
  EXPECT_FALSE(fs::exists(dir / "hf/model.safetensors.index.json"));  // the earlier shards are gone
  EXPECT_EQ(read_json(dir / "hf/config.json")["torch_dtype"], "bfloat16");
  EXPECT_EQ(load_tensors(dir / "hf/model.safetensors").at("model.norm.weight").scalar_type(), torch::kBFloat16);
}

TEST(Prepare, StreamsFilesIntoTokenFilesWithTheirTokenizer) {
  TempDir dir;
  fs::create_directories(dir / "corpus/sub");
  const auto text = noloco::testing::shakespeare(60000);
  noloco::testing::write_text(dir / "corpus/a.txt", text.substr(0, 30000));
  noloco::testing::write_text(dir / "corpus/sub/b.txt", text.substr(30000));
  noloco::testing::write_text(dir / "corpus/.hidden", "ignored");
  PrepareOptions o;
  o.inputs = {dir / "corpus"};
  o.out = dir / "tokens";
  o.vocab_size = 400;
  o.val_fraction = 0.1;
  const auto r = prepare_corpus(o);
  EXPECT_EQ(r.files, 2);
  EXPECT_EQ(r.bytes, 60000);
  const auto train = read_token_file(dir / "tokens/train_000000.bin"), val = read_token_file(dir / "tokens/val_000000.bin");
  EXPECT_EQ(int64_t(train.size()), r.train_tokens);
  EXPECT_EQ(int64_t(val.size()), r.val_tokens);
  const auto tokenizer = load_tokenizer(dir / "tokens");
  EXPECT_EQ(tokenizer->vocab_size(), 400);
  const double whole = double(tokenizer->encode(text.substr(0, 30000)).size() + tokenizer->encode(text.substr(30000)).size());
  EXPECT_NEAR(double(train.size() + val.size()), whole, 0.01 * whole);
  EXPECT_NEAR(double(val.size()), 0.1 * whole, 0.01 * whole);

  // One file of one chunk: train is the head of its tokens and val the tail,
  // so together they decode to the text. (Pieces are encoded separately, and
  // sentencepiece starts each with its dummy-prefix space: compare without spaces.)
  auto without_spaces = [](std::string s) {
    s.erase(std::remove(s.begin(), s.end(), ' '), s.end());
    return s;
  };
  o.inputs = {dir / "corpus/a.txt"};
  o.out = dir / "one";
  o.tokenizer = dir / "tokens";
  const auto one = prepare_corpus(o);
  auto ids = read_token_file(dir / "one/train_000000.bin");
  const auto tail = read_token_file(dir / "one/val_000000.bin");
  EXPECT_EQ(int64_t(tail.size()), int64_t(double(one.train_tokens + one.val_tokens) * 0.1));
  ids.insert(ids.end(), tail.begin(), tail.end());
  EXPECT_EQ(without_spaces(tokenizer->decode({ids.begin(), ids.end()})), without_spaces(text.substr(0, 30000)));

  // Small chunks, cut at line ends: about as many tokens, a tenth held out.
  o.out = dir / "small_chunks";
  o.chunk_bytes = 2048;
  const auto chunked = prepare_corpus(o);
  const double a_tokens = double(one.train_tokens + one.val_tokens);
  EXPECT_NEAR(double(chunked.train_tokens + chunked.val_tokens), a_tokens, 0.02 * a_tokens);
  EXPECT_NEAR(double(chunked.val_tokens), 0.1 * a_tokens, 0.02 * a_tokens);

  o.inputs = {dir / "missing"};
  EXPECT_NE(error_of([&] { prepare_corpus(o); }).find("neither a file nor a directory"), std::string::npos);
  o.inputs = {dir / "corpus"};
  o.tokenizer = "char";
  EXPECT_THROW(prepare_corpus(o), std::invalid_argument);
}

TEST(Prepare, TokenFileWriterLeavesNoPartialFile) {
  TempDir dir;
  {
    TokenFileWriter w(dir / "t.bin", false);
    w.append({1, 2, 3}, 0, 3);
    EXPECT_THROW(w.append({70000}, 0, 1), std::runtime_error);
  }
  EXPECT_FALSE(fs::exists(dir / "t.bin"));
  EXPECT_FALSE(fs::exists(dir / "t.bin.tmp"));
  TokenFileWriter w(dir / "t.bin", false);
  w.append({5, 6, 65535, 7}, 1, 2);
  w.finish();
  EXPECT_EQ(read_token_file(dir / "t.bin"), (std::vector<int32_t>{6, 65535}));
  TokenFileWriter wide(dir / "w.bin", true);
  wide.append({70000, 128000}, 0, 2);
  wide.finish();
  EXPECT_EQ(read_token_file(dir / "w.bin"), (std::vector<int32_t>{70000, 128000}));
}

// Issue 31: directories shaped like Llama 3.2 (rope_scaling llama3, tied
// embeddings, grouped-query attention, head_dim given (here not
// hidden/heads), a byte-level BPE tokenizer.json past 65 536 ids) and SmolLM2
// (tied, GQA, digits one by one), small. Each as one model.safetensors, as
// such models are published: import gives the logits of the model written,
// generate works on the directory, prepare writes uint32 token files where
// the vocabulary needs them, and a run started from it trains tied and
// exports the same tokenizer, rope scaling, head_dim and tying back.
TEST_F(HfRun, Llama32AndSmolLM2ShapedDirectoriesRoundTrip) {
  struct Shape {
    std::string name;
    ModelConfig model;
    nlohmann::json tokenizer;
  };
  ModelConfig llama = small_model(2);
  llama.vocab_size = 70001;
  llama.rope_theta = 500000.0;
  llama.rope_scaling = RopeScaling{"llama3", 32.0, 1.0, 4.0, 8192};
  llama.head_size = 12;  // 4 heads x 12 in a 32-wide model
  llama.tied_embeddings = true;
  auto llama_tokenizer = noloco::testing::llama3_style();
  llama_tokenizer["added_tokens"].push_back({{"id", 70000}, {"content", "<|eot_id|>"}, {"special", true}});
  ModelConfig smol = small_model(1);
  smol.vocab_size = 257;
  smol.tied_embeddings = true;
  for (const auto& shape : {Shape{"llama32", llama, llama_tokenizer}, Shape{"smollm2", smol, noloco::testing::smollm2_style()}}) {
    SCOPED_TRACE(shape.name);
    const std::string hf = dir / shape.name;
    torch::manual_seed(3);
    LlamaForCausalLM model(shape.model);
    write_directory(hf, model, uint64_t(1) << 40);
    noloco::testing::write_text(hf + "/tokenizer.json", shape.tokenizer.dump());
    ASSERT_TRUE(fs::exists(hf + "/model.safetensors"));

    auto back = imported(hf);
    EXPECT_TRUE(torch::equal(logits(back), logits(model)));
    EXPECT_EQ(back->config.to_json(), shape.model.to_json());

    const auto generated = noloco::testing::run_cli("generate " + hf + " tokens=8 temperature=0 prompt=the", 60);
    EXPECT_EQ(generated.exit_code, 0) << generated.output;

    noloco::testing::write_text(dir / "text.txt", noloco::testing::shakespeare(4000) + "<|eot_id|>\n");
    PrepareOptions p;
    p.inputs = {dir / "text.txt"};
    p.out = dir / (shape.name + "_tokens");
    p.tokenizer = hf;
    prepare_corpus(p);
    const auto bytes = noloco::testing::read_text(p.out + "/train_000000.bin");
    const int32_t magic = int32_t(uint8_t(bytes[0]) | (uint8_t(bytes[1]) << 8) | (uint8_t(bytes[2]) << 16) |
                                  (uint8_t(bytes[3]) << 24));
    EXPECT_EQ(magic, shape.model.vocab_size > 65536 ? 20240801 : 20240520);
    const auto val = read_token_file(p.out + "/val_000000.bin");
    if (shape.model.vocab_size > 65536) EXPECT_NE(std::find(val.begin(), val.end(), 70000), val.end());

    train_run(shape.name + "_run", {"init_from=" + hf, "data=" + p.out + "/train_000000.bin", "val_data=" + p.out + "/val_000000.bin",
                                    "steps=1", "context=16", "batch=2"});
    ExportOptions o;
    export_hf(dir / (shape.name + "_run"), dir / (shape.name + "_export"), o);
    EXPECT_EQ(noloco::testing::read_text(dir / (shape.name + "_export/tokenizer.json")), shape.tokenizer.dump());
    const auto exported_config = read_hf_config(dir / (shape.name + "_export"));
    EXPECT_EQ(exported_config.rope_scaling, shape.model.rope_scaling);
    EXPECT_EQ(exported_config.head_dim(), shape.model.head_dim());
    EXPECT_TRUE(exported_config.tied_embeddings);
    EXPECT_FALSE(load_tensors(dir / (shape.name + "_export/model.safetensors")).count("lm_head.weight"));
    const auto ckpt = read_whole_model(find_checkpoint(dir / (shape.name + "_run")));
    LlamaForCausalLM trained(ckpt.model);
    {
      torch::NoGradGuard g;
      for (auto& param : trained->named_parameters()) param.value().copy_(ckpt.weights.at(param.key()));
    }
    auto exported = imported(dir / (shape.name + "_export"));
    EXPECT_TRUE(torch::equal(logits(exported), logits(trained)));
    EXPECT_FALSE(torch::equal(logits(exported), logits(model)));  // it trained

    // Untied on request: the head starts as a copy and is exported as its own matrix.
    train_run(shape.name + "_untied", {"init_from=" + hf, "data=" + p.out + "/train_000000.bin", "val_data=" + p.out + "/val_000000.bin",
                                       "steps=1", "context=16", "batch=2", "tie_embeddings=false"});
    export_hf(dir / (shape.name + "_untied"), dir / (shape.name + "_untied_export"), o);
    EXPECT_FALSE(read_hf_config(dir / (shape.name + "_untied_export")).tied_embeddings);
    const auto untied = load_tensors(dir / (shape.name + "_untied_export/model.safetensors"));
    EXPECT_FALSE(torch::equal(untied.at("lm_head.weight"), untied.at("model.embed_tokens.weight")));
  }
}

// Issue 103: what goes in comes out. The export keeps the imported
// config.json's fields and spellings; a field training changed is taken, and said.
TEST(HfDirectory, AnExportKeepsTheImportedFieldsAndNamesWhatTrainingChanged) {
  const auto imported = nlohmann::json::parse(R"({"architectures": ["LlamaForCausalLM"], "hidden_size": 64,
      "max_position_embeddings": 4096, "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"},
      "bos_token_id": 1, "eos_token_id": [2, 3], "rms_norm_eps": 1e-05, "tie_word_embeddings": true,
      "dtype": "bfloat16", "transformers_version": "5.24.0"})");
  auto ours = imported;
  ours["max_position_embeddings"] = 64;  // the training context
  ours["rms_norm_eps"] = 0.00001;        // the same number, another spelling
  ours["rope_theta"] = 500000.0;         // a key the import does not use
  std::vector<std::string> changed;
  EXPECT_EQ(keep_imported_config(imported, ours, &changed), imported);
  EXPECT_TRUE(changed.empty());
  ours["tie_word_embeddings"] = false;  // untied for training (tie_embeddings=false)
  ours["dtype"] = "float32";            // dtype=float32 asked
  const auto exported = keep_imported_config(imported, ours, &changed);
  EXPECT_EQ(exported["tie_word_embeddings"], false);
  EXPECT_EQ(exported["max_position_embeddings"], 4096);
  EXPECT_FALSE(exported.contains("rope_theta"));
  EXPECT_EQ(changed, (std::vector<std::string>{"dtype \"bfloat16\" -> \"float32\"", "tie_word_embeddings true -> false"}));
}
