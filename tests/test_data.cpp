#include <gtest/gtest.h>

#include <numeric>

#include "data/dataset.h"
#include "data/token_file.h"
#include "data/token_stream.h"
#include "data/tokenizer.h"
#include "test_util.h"
#include "util/files.h"

using namespace noloco;
using noloco::testing::TempDir;
using noloco::testing::error_of;

TEST(Tokenizer, CharRoundTripAndSaveLoad) {
  const std::string text = noloco::testing::shakespeare(5000);
  auto tok = make_char_tokenizer(text);
  EXPECT_EQ(tok->decode(tok->encode(text)), text);
  TempDir dir;
  tok->save(dir.path());
  auto loaded = load_tokenizer(dir.path());
  EXPECT_EQ(loaded->vocab_size(), tok->vocab_size());
  EXPECT_EQ(loaded->encode(text), tok->encode(text));
  EXPECT_THROW(tok->encode("\x01"), std::invalid_argument);
}

TEST(Tokenizer, BpeTrainsToTheRequestedSizeAndRoundTrips) {
  TempDir dir;
  const std::string text = noloco::testing::shakespeare(200000);
  noloco::testing::write_text(dir / "corpus.txt", text);
  auto tok = train_bpe_tokenizer({dir / "corpus.txt"}, 1000);
  EXPECT_EQ(tok->vocab_size(), 1000);
  const std::string sample = text.substr(1000, 3000);
  const auto ids = tok->encode(sample);
  EXPECT_LT(ids.size(), sample.size() * 6 / 10);  // merges actually compress
  EXPECT_EQ(tok->decode(ids), sample);
  tok->save(dir.path());
  auto loaded = load_tokenizer(dir.path());
  EXPECT_EQ(loaded->kind(), "sentencepiece");
  EXPECT_EQ(loaded->encode(sample), ids);
  // An existing .model file is a tokenizer too.
  EXPECT_EQ(load_sentencepiece(dir / "tokenizer.model")->encode(sample), ids);
}

TEST(TokenFile, LlmcLayoutRoundTrip) {
  TempDir dir;
  std::vector<int32_t> tokens = {0, 1, 65535, 42, 7};
  write_token_file(dir / "t.bin", tokens);
  EXPECT_EQ(read_token_file(dir / "t.bin"), tokens);
  auto bytes = noloco::testing::read_text(dir / "t.bin");
  EXPECT_EQ(bytes.size(), 1024u + 2 * tokens.size());
  EXPECT_EQ(bytes.substr(0, 8), std::string("\x88\xd8\x34\x01\x01\x00\x00\x00", 8));  // 20240520, version 1
  // An id past uint16 (a Llama 3 vocabulary): llm.c's uint32 layout, magic 20240801, version 7.
  tokens.push_back(128255);
  write_token_file(dir / "w.bin", tokens);
  EXPECT_EQ(read_token_file(dir / "w.bin"), tokens);
  bytes = noloco::testing::read_text(dir / "w.bin");
  EXPECT_EQ(bytes.size(), 1024u + 4 * tokens.size());
  EXPECT_EQ(bytes.substr(0, 8), std::string("\xa1\xd9\x34\x01\x07\x00\x00\x00", 8));
  EXPECT_EQ(bytes.substr(1024 + 4 * 5, 4), std::string("\xff\xf4\x01\x00", 4));  // 128255 little-endian
  bytes[4] = 1;  // version 1 with the uint32 magic
  EXPECT_THROW(parse_token_file(bytes), std::runtime_error);
}

TEST(TokenFile, RawNanoGptLayout) {
  EXPECT_EQ(parse_token_file(std::string("\x01\x00\x02\x01", 4)), (std::vector<int32_t>{1, 258}));
  EXPECT_THROW(parse_token_file(std::string("\x01\x00\x02", 3)), std::runtime_error);
}

TEST(TokenFile, HeaderClaimingMoreTokensThanPresentIsRejected) {
  TempDir dir;
  write_token_file(dir / "t.bin", {1, 2, 3, 4});
  auto bytes = noloco::testing::read_text(dir / "t.bin");
  bytes.resize(bytes.size() - 2);
  try {
    parse_token_file(bytes);
    FAIL();
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("claims 4 tokens but holds 3"), std::string::npos);
  }
}

TEST(Corpus, SplitsTheLastTenPercentForValidation) {
  TempDir dir;
  noloco::testing::write_text(dir / "c.txt", noloco::testing::shakespeare(10000));
  TrainConfig c;
  c.data.path = dir / "c.txt";
  auto corpus = load_corpus(c.data, c.model.context, dir / "run");
  EXPECT_EQ(corpus.val.size(), 1000);
  EXPECT_EQ(corpus.train.size(), 9000);
}

TEST(Corpus, TokenFileNeedsVocabularyAndIsChecked) {
  TempDir dir;
  std::vector<int32_t> ids(2000, 3);
  ids[500] = 7;
  write_token_file(dir / "t.bin", ids);
  TrainConfig c;
  c.data.path = dir / "t.bin";
  c.data.vocab_size = 50;
  auto corpus = load_corpus(c.data, c.model.context, "");
  EXPECT_EQ(corpus.tokenizer->vocab_size(), 50);
  // Id 7 in the training part is outside a vocabulary of 7: refused when a
  // window reads it (reading the whole corpus at start-up would grow with it).
  c.data.vocab_size = 7;
  c.data.val_fraction = 0.5;
  corpus = load_corpus(c.data, 16, "");
  std::vector<int64_t> out(2000);
  EXPECT_NE(error_of([&] { corpus.train.read(0, 1000, out.data()); }).find("t.bin' holds token id 7 outside the vocabulary of 7 (its token 500)"),
            std::string::npos);
  // In the validation part it is refused up front.
  c.data.val_fraction = 0.8;
  EXPECT_NE(error_of([&] { load_corpus(c.data, 16, ""); }).find("holds token id 7"), std::string::npos);
  // A file that declares a larger vocabulary than the tokenizer's is refused up front.
  write_token_file(dir / "v.bin", std::vector<int32_t>(2000, 3), 100);
  c.data.path = dir / "v.bin";
  c.data.vocab_size = 50;
  EXPECT_NE(error_of([&] { load_corpus(c.data, 16, ""); }).find("prepared for a vocabulary of 100, more than the tokenizer's 50"),
            std::string::npos);
}

TEST(Sampler, WindowsAreShiftedSeededAndSliceable) {
  std::vector<int32_t> ids(1000);
  std::iota(ids.begin(), ids.end(), 0);
  const auto tokens = TokenStream::hold(ids, "arange");
  WindowSampler s(tokens, 16, 42);
  auto b = s.sample(5, 0, 8);
  EXPECT_TRUE(torch::equal(b.targets, b.inputs + 1));  // next-token targets
  EXPECT_TRUE(torch::equal(s.sample(5, 0, 8).inputs, b.inputs));  // pure function of its arguments
  EXPECT_FALSE(torch::equal(s.sample(6, 0, 8).inputs, b.inputs));
  // Two replicas of batch 4 see exactly what one replica of batch 8 sees.
  auto r0 = s.sample(5, 0, 4), r1 = s.sample(5, 4, 4);
  EXPECT_TRUE(torch::equal(torch::cat({r0.inputs, r1.inputs}), b.inputs));
  EXPECT_FALSE(torch::equal(WindowSampler(tokens, 16, 43).sample(5, 0, 8).inputs, b.inputs));
}

TEST(Corpus, ADirectoryWithoutShardsIsRefused) {
  TempDir dir;
  noloco::testing::write_text(dir / "notes.txt", "text");
  TrainConfig c;
  c.data.path = dir.path();
  EXPECT_NE(error_of([&] { load_corpus(c.data, c.model.context, ""); }).find("names no token files"), std::string::npos);
  c.data.path = dir / "fineweb_train_*.bin";
  EXPECT_NE(error_of([&] { load_corpus(c.data, c.model.context, ""); }).find("names no token files"), std::string::npos);
}

TEST(Tokenizer, ACharVocabularyOfImpossibleBytesIsRefused) {
  TempDir dir;
  noloco::testing::write_text(dir / "tokenizer.json", R"({"type": "char", "bytes": [97, 9999]})");
  EXPECT_THROW(load_tokenizer(dir.path()), std::runtime_error);
  noloco::testing::write_text(dir / "tokenizer.json", R"({"type": "char", "bytes": [97, 97]})");
  EXPECT_THROW(load_tokenizer(dir.path()), std::runtime_error);
}
