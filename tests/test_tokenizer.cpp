// Byte-level BPE from Hugging Face's tokenizer.json: the GPT-2 / SmolLM2 and
// Llama 3 pre-tokenizer splits on Unicode text, merges by rank, added
// tokens, lossless round trips, and the files kept for runs and exports.
// The fixtures (tokenizer_fixtures.h) give every byte the id of its value,
// so the expected ids follow by hand from that table and the merge ranks;
// the expected splits follow from the published patterns (GPT-2's regular
// expression, Llama 3's, the Digits pre-tokenizer).
#include <gtest/gtest.h>

#include <filesystem>
#include <sstream>

#include <nlohmann/json.hpp>

#include "data/byte_level_bpe.h"
#include "data/tokenizer.h"
#include "test_util.h"
#include "tokenizer_fixtures.h"
#include "util/files.h"

using namespace noloco;
using noloco::testing::TempDir;
using Json = nlohmann::json;
using Pieces = std::vector<std::string>;
using Ids = std::vector<int32_t>;

namespace {

using namespace noloco::testing;

ByteLevelBpe make(const Json& j) { return ByteLevelBpe(j.dump(), "", "test tokenizer.json"); }

const std::vector<std::string> kTexts = {
    "Hello world's 123",  "don't   stop",   "café au lait, naïve", "日本語のテキスト",  "emoji 🙂🚀 and ZWJ 👩‍👩‍👧",
    "digits 1234567 and 3.14159", "tabs\tand\nnewlines\r\n\n  indented", "WE'LL SEE: it's fine", "\xff\xfe raw bytes",
    "  leading and trailing  ",   "<|endoftext|>x<|begin_of_text|>y<|im_start|>"};

}  // namespace

TEST(ByteLevelBpe, Gpt2PatternSplitsAsPublished) {
  const auto t = make(gpt2_style());
  EXPECT_EQ(t.pre_tokenize("Hello world's 123"), (Pieces{"Hello", " world", "'s", " 123"}));
  // A run of spaces keeps its last one for the next word.
  EXPECT_EQ(t.pre_tokenize("don't   stop"), (Pieces{"don", "'t", "  ", " stop"}));
  // Letters are \p{L} (accents, CJK); an emoji is a symbol.
  EXPECT_EQ(t.pre_tokenize("café 日本語 🙂!!"), (Pieces{"café", " 日本語", " 🙂!!"}));
  EXPECT_EQ(t.pre_tokenize("x\n\ny"), (Pieces{"x", "\n", "\n", "y"}));
}

TEST(ByteLevelBpe, Llama3PatternSplitsAsPublished) {
  const auto t = make(llama3_style());
  EXPECT_EQ(t.pre_tokenize("12345"), (Pieces{"123", "45"}));              // at most three digits
  EXPECT_EQ(t.pre_tokenize("DON'T"), (Pieces{"DON", "'T"}));              // contractions in any case
  EXPECT_EQ(t.pre_tokenize("  hello"), (Pieces{" ", " hello"}));
  EXPECT_EQ(t.pre_tokenize("Hello\n\nworld"), (Pieces{"Hello", "\n\n", "world"}));
  EXPECT_EQ(t.pre_tokenize("(x)"), (Pieces{"(x", ")"}));                  // one non-letter may lead a word
}

TEST(ByteLevelBpe, SmolLM2DigitsComeOneByOne) {
  const auto t = make(smollm2_style());
  EXPECT_EQ(t.pre_tokenize("in 2024!"), (Pieces{"in", " ", "2", "0", "2", "4", "!"}));
  // Digits are the tokenizers library's is_numeric (Unicode N): Hugging Face
  // gives 'Ġ', 'Â', '½' for " ½" on StarCoder's vocabulary (llama.cpp's test data).
  EXPECT_EQ(t.pre_tokenize("4 ½ ٣x"), (Pieces{"4", " ", "½", " ", "٣", "x"}));
}

TEST(ByteLevelBpe, MergesApplyByRankAndAddedTokensAreCutFirst) {
  const auto t = make(gpt2_style());
  // "the": t h e -> (h e) is the only ranked pair -> t, he.
  EXPECT_EQ(t.encode("the"), (Ids{'t', 257}));
  // " the": Ġ t h e -> (Ġ t) rank 0 -> Ġt h e -> (h e) rank 1 -> Ġt he -> (Ġt he) rank 2 -> Ġthe.
  EXPECT_EQ(t.encode(" the"), (Ids{258}));
  EXPECT_EQ(t.encode("the<|endoftext|> the"), (Ids{'t', 257, 260, 258}));
  // Bytes beyond ASCII are their UTF-8 bytes: é = c3 a9, 🙂 = f0 9f 99 82.
  EXPECT_EQ(t.encode("é"), (Ids{0xc3, 0xa9}));
  EXPECT_EQ(t.encode("🙂"), (Ids{0xf0, 0x9f, 0x99, 0x82}));
  EXPECT_EQ(t.vocab_size(), 261);
  // ignore_merges: a piece that is a token is taken whole, whatever the merges say.
  const auto l = make(llama3_style());
  EXPECT_EQ(l.encode(" the"), (Ids{256}));
  EXPECT_EQ(l.encode("12345"), (Ids{258, '4', '5'}));  // pieces 123 (a token) and 45 (no merge)
  EXPECT_EQ(l.encode("124"), (Ids{257, '4'}));  // "124" is no token: merged "1 2" -> 12, then 4
  EXPECT_EQ(l.encode("<|begin_of_text|>the"), (Ids{259, 't', 'h', 'e'}));
}

TEST(ByteLevelBpe, EveryTextRoundTrips) {
  for (const auto& j : {gpt2_style(), llama3_style(), smollm2_style()}) {
    const auto t = make(j);
    for (const auto& text : kTexts) EXPECT_EQ(t.decode(t.encode(text)), text) << text;
  }
  // An id that names no token (a model's padded vocabulary) decodes to nothing, as in the tokenizers library.
  EXPECT_EQ(make(gpt2_style()).decode({'a', 261, -1, 'b'}), "ab");
}

TEST(ByteLevelBpe, RunsAndExportsKeepTheFilesAsTheyCame) {
  TempDir dir;
  const std::string json = llama3_style().dump(2);
  const std::string config = R"({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>"})";
  std::filesystem::create_directories(dir / "model");
  noloco::testing::write_text(dir / "model/tokenizer.json", json);
  noloco::testing::write_text(dir / "model/tokenizer_config.json", config);
  ASSERT_TRUE(holds_tokenizer(dir / "model"));
  const auto t = load_tokenizer(dir / "model");
  EXPECT_EQ(t->kind(), "byte-level BPE");
  std::filesystem::create_directories(dir / "run");
  std::filesystem::create_directories(dir / "export");
  t->save(dir / "run");
  // Issue 103: a run's (and `prepare`'s) tokenizer.json is the Hugging Face file, unchanged.
  EXPECT_EQ(noloco::testing::read_text(dir / "run/tokenizer.json"), json);
  EXPECT_EQ(noloco::testing::read_text(dir / "run/tokenizer_config.json"), config);
  EXPECT_FALSE(std::filesystem::exists(dir / "run/hf_tokenizer.json"));
  const auto again = load_tokenizer(dir / "run");
  for (const auto& text : kTexts) EXPECT_EQ(again->encode(text), t->encode(text)) << text;
  // Runs of earlier versions: the file under another name, and ours naming it.
  std::filesystem::create_directories(dir / "old_run");
  noloco::testing::write_text(dir / "old_run/hf_tokenizer.json", json);
  noloco::testing::write_text(dir / "old_run/tokenizer.json", R"({"type": "byte_level_bpe", "file": "hf_tokenizer.json"})");
  const auto old = load_tokenizer(dir / "old_run");
  for (const auto& text : kTexts) EXPECT_EQ(old->encode(text), t->encode(text)) << text;
  again->save_hf(dir / "export");
  EXPECT_EQ(noloco::testing::read_text(dir / "export/tokenizer.json"), json);
  EXPECT_EQ(noloco::testing::read_text(dir / "export/tokenizer_config.json"), config);
}

TEST(ByteLevelBpe, WhatIsNotImplementedIsNamedInOneLine) {
  auto error = [](Json j) {
    try {
      make(j);
    } catch (const std::runtime_error& e) {
      return std::string(e.what());
    }
    return std::string("(accepted)");
  };
  auto j = gpt2_style();
  j["normalizer"] = {{"type", "NFC"}};
  EXPECT_NE(error(j).find("normalizer 'NFC' is not implemented"), std::string::npos) << error(j);
  j = gpt2_style();
  j["model"]["type"] = "WordPiece";
  EXPECT_NE(error(j).find("model type 'WordPiece' is not implemented"), std::string::npos);
  j = gpt2_style();
  j["pre_tokenizer"] = {{"type", "Metaspace"}};
  EXPECT_NE(error(j).find("pre-tokenizer 'Metaspace' is not implemented"), std::string::npos);
  j = gpt2_style();
  j["model"]["continuing_subword_prefix"] = "##";
  EXPECT_NE(error(j).find("BPE 'continuing_subword_prefix' is not implemented"), std::string::npos);
  j["model"]["continuing_subword_prefix"] = "";  // as GPT-2's own file writes "none"
  EXPECT_EQ(error(j), "(accepted)");
  j = gpt2_style();
  j["model"]["vocab"].erase(byte_level_char(0x41));
  EXPECT_NE(error(j).find("lacks byte 0x41"), std::string::npos);
  // A byte beyond ASCII may be missing (StarCoder's vocabulary); text holding it is refused in one line.
  j = gpt2_style();
  j["model"]["vocab"].erase(byte_level_char(0xff));
  EXPECT_EQ(error(j), "(accepted)");
  EXPECT_EQ(make(j).encode("café"), make(gpt2_style()).encode("café"));
  try {
    make(j).encode("raw \xff byte");
    ADD_FAILURE() << "a byte without a token was encoded";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("holds byte 0xff, which this vocabulary has no token for"), std::string::npos)
        << e.what();
  }
  j = gpt2_style();
  j["model"]["merges"].push_back("Ġ x");
  EXPECT_NE(error(j).find("outside the vocabulary"), std::string::npos);
  j = gpt2_style();
  j["pre_tokenizer"] = {{"type", "Split"}, {"pattern", {{"Regex", "(unclosed"}}}, {"behavior", "Isolated"}};
  EXPECT_NE(error(j).find("does not compile"), std::string::npos);
  EXPECT_EQ(error(gpt2_style()), "(accepted)");
}

// The real GPT-2 vocabulary (50 257 tokens, 50 000 merges; MIT, OpenAI), made
// into tests/fixtures/gpt2/tokenizer.json by scripts/gguf_vocab_to_tokenizer_json.py
// from llama.cpp's models/ggml-vocab-gpt-2.gguf, against the ids Hugging Face's
// tokenizer gave for llama.cpp's 46 test texts (models/ggml-vocab-gpt-2.gguf.inp
// and .out, MIT): accents, Cyrillic, CJK, emoji, digit and whitespace runs,
// contractions.
TEST(ByteLevelBpe, TheRealGpt2VocabularyGivesHuggingFacesIds) {
  const std::string dir = std::string(NOLOCO_SOURCE_DIR) + "/tests/fixtures/gpt2";
  const auto t = load_tokenizer(dir);
  EXPECT_EQ(t->vocab_size(), 50257);
  const std::string inputs = noloco::testing::read_text(dir + "/llama_cpp_vocab_test.inp");
  const std::string sep = "\n__ggml_vocab_test__\n";
  std::vector<std::string> texts;
  for (size_t pos = 0; pos < inputs.size();) {
    const size_t next = inputs.find(sep, pos);
    texts.push_back(inputs.substr(pos, next == std::string::npos ? std::string::npos : next - pos));
    if (next == std::string::npos) break;
    pos = next + sep.size();
  }
  std::istringstream outputs(noloco::testing::read_text(dir + "/llama_cpp_vocab_test.out"));
  std::vector<Ids> expected;
  for (std::string line; std::getline(outputs, line);) {
    std::istringstream ids(line);
    Ids row;
    for (int32_t id; ids >> id;) row.push_back(id);
    expected.push_back(row);
  }
  ASSERT_EQ(texts.size(), 46u);
  ASSERT_EQ(expected.size(), texts.size());
  for (size_t i = 0; i < texts.size(); ++i) {
    EXPECT_EQ(t->encode(texts[i]), expected[i]) << "text " << i << ": '" << texts[i] << "'";
    EXPECT_EQ(t->decode(expected[i]), texts[i]) << "text " << i;
  }
}
