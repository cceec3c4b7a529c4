// Corpora larger than memory (issue 48): llm.c shard sets mapped where they
// lie and read as one stream, text read as documents from plain, JSONL, gzip
// and zstd files, and `prepare` writing shards.
#include <gtest/gtest.h>
#include <zlib.h>
#include <zstd.h>

#include <filesystem>
#include <numeric>

#include <nlohmann/json.hpp>

#include "data/dataset.h"
#include "data/prepare.h"
#include "data/text_source.h"
#include "data/token_file.h"
#include "data/token_stream.h"
#include "data/tokenizer.h"
#include "test_util.h"
#include "tokenizer_fixtures.h"

using namespace noloco;
using noloco::testing::TempDir;
using noloco::testing::error_of;
namespace fs = std::filesystem;

namespace {

std::vector<int32_t> sequence(size_t n, int32_t vocab) {
  std::vector<int32_t> ids(n);
  for (size_t i = 0; i < n; ++i) ids[i] = int32_t((i * 7 + i / 13) % size_t(vocab));
  return ids;
}

// `ids` as shards of at most `per_shard` tokens, written in uneven appends.
void write_shards(const std::string& dir, const std::string& prefix, const std::vector<int32_t>& ids,
                  int64_t per_shard, int64_t vocab, bool wide = false) {
  ShardWriter w(dir, prefix, per_shard, wide, vocab);
  for (size_t at = 0; at < ids.size(); at += 777) w.append(ids, at, std::min<size_t>(777, ids.size() - at));
  w.finish();
}

std::vector<int64_t> read_all(const TokenStream& s) {
  std::vector<int64_t> out(size_t(s.size()));
  s.read(0, s.size(), out.data());
  return out;
}

std::vector<int64_t> widened(const std::vector<int32_t>& ids, size_t from, size_t to) {
  return {ids.begin() + long(from), ids.begin() + long(to)};
}

}  // namespace

TEST(Shards, ASetReadsAsOneStreamAcrossShardBoundaries) {
  TempDir dir;
  const auto ids = sequence(3500, 300);
  write_shards(dir.path(), "train", ids, 1000, 300);
  write_shards(dir.path(), "val", sequence(200, 300), 1000, 300);
  const auto files = token_files(dir.path());  // a directory: its train shards, in order
  ASSERT_EQ(files.size(), 4u);
  EXPECT_EQ(fs::path(files[0]).filename(), "train_000000.bin");
  EXPECT_EQ(fs::path(files[3]).filename(), "train_000003.bin");
  EXPECT_EQ(token_files(dir / "train_*.bin"), files);
  EXPECT_EQ(validation_files_beside(dir.path()), std::vector<std::string>{dir / "val_000000.bin"});

  const auto stream = TokenStream::map_files(files);
  EXPECT_EQ(stream.size(), 3500);
  EXPECT_EQ(stream.declared_vocab(), 300);
  EXPECT_EQ(read_all(stream), widened(ids, 0, 3500));
  std::vector<int64_t> window(30);
  stream.read(990, 30, window.data());  // across the first boundary
  EXPECT_EQ(window, widened(ids, 990, 1020));
  const auto middle = stream.slice(100, 3400);
  middle.read(2890, 30, window.data());  // 2990..3020 of the set, across the third boundary
  EXPECT_EQ(window, widened(ids, 2990, 3020));
  EXPECT_THROW(middle.read(3290, 20, window.data()), std::out_of_range);

  // Written again shorter, the set has no stale shard from before.
  write_shards(dir.path(), "train", sequence(1500, 300), 1000, 300);
  EXPECT_EQ(token_files(dir.path()).size(), 2u);
  EXPECT_FALSE(fs::exists(dir / "train_000002.bin"));
}

TEST(Shards, ASetSamplesTheWindowsOfTheSameTokensInOneFile) {
  TempDir dir;
  const auto ids = sequence(5000, 1000);
  write_token_file(dir / "one.bin", ids);
  fs::create_directories(dir / "set");
  write_shards(dir / "set", "train", ids, 700, 1000);
  const WindowSampler one(TokenStream::map_files({dir / "one.bin"}), 64, 5);
  const WindowSampler set(TokenStream::map_files(token_files(dir / "set")), 64, 5);
  for (uint64_t index = 0; index < 20; ++index) {
    const auto a = one.sample(index, 0, 8), b = set.sample(index, 0, 8);
    EXPECT_TRUE(torch::equal(a.inputs, b.inputs)) << index;
    EXPECT_TRUE(torch::equal(a.targets, b.targets)) << index;
  }
}

TEST(Shards, MalformedShardsAreRefusedInOneLineNamingTheShard) {
  TempDir dir;
  const auto ids = sequence(1000, 300);
  auto expect_refused = [&](const std::string& bad, const std::string& needle) {
    fs::remove_all(dir / "set");
    fs::create_directories(dir / "set");
    write_token_file(dir / "set/train_000000.bin", ids, 300);
    noloco::testing::write_text(dir / "set/train_000001.bin", bad);
    const auto error = error_of([&] { TokenStream::map_files(token_files(dir / "set")); });
    EXPECT_NE(error.find(dir / "set/train_000001.bin"), std::string::npos) << error;
    EXPECT_NE(error.find(needle), std::string::npos) << error;
    EXPECT_EQ(error.find('\n'), std::string::npos) << error;
  };
  write_token_file(dir / "good.bin", ids, 300);
  const auto good = noloco::testing::read_text(dir / "good.bin");
  expect_refused(good.substr(0, good.size() - 2), "claims 1000 tokens but holds 999");
  expect_refused(good + std::string(2, '\0'), "claims 1000 tokens but holds 1001");
  expect_refused(good.substr(0, good.size() - 1), "and a partial one");
  auto magic = good;
  magic[0] = 'X';
  expect_refused(magic, "unknown magic");
  write_token_file(dir / "wide.bin", {70000, 1, 2}, 300);
  expect_refused(noloco::testing::read_text(dir / "wide.bin"), "uint32 ids where");
  write_token_file(dir / "other.bin", ids, 400);
  expect_refused(noloco::testing::read_text(dir / "other.bin"), "declares a vocabulary of 400 where the shards before it declare 300");
  expect_refused("", "empty token file");
}

TEST(TextSource, GzipAndZstdReadAsTheirPlainText) {
  TempDir dir;
  const auto text = noloco::testing::shakespeare(300000);
  noloco::testing::write_text(dir / "t.txt", text);
  gzFile gz = gzopen((dir / "t.txt.gz").c_str(), "wb");
  ASSERT_EQ(gzwrite(gz, text.data(), unsigned(text.size())), int(text.size()));
  gzclose(gz);
  std::string zst(ZSTD_compressBound(text.size()), '\0');
  zst.resize(ZSTD_compress(zst.data(), zst.size(), text.data(), text.size(), 3));
  noloco::testing::write_text(dir / "t.txt.zst", zst);
  for (const std::string name : {"t.txt", "t.txt.gz", "t.txt.zst"}) {
    TextChunks chunks(dir / name, 4096);
    std::string chunk, back;
    while (chunks.next(chunk)) {
      EXPECT_LE(chunk.size(), 4096u);
      back += chunk;
      if (back.size() < text.size()) EXPECT_EQ(chunk.back(), '\n');  // cut at line ends
    }
    EXPECT_EQ(back, text) << name;
  }
  // Cut short, either is refused naming the file.
  noloco::testing::write_text(dir / "cut.txt.zst", zst.substr(0, zst.size() / 2));
  noloco::testing::write_text(dir / "cut.txt.gz", noloco::testing::read_text(dir / "t.txt.gz").substr(0, 5000));
  for (const std::string name : {"cut.txt.zst", "cut.txt.gz"}) {
    const auto error = error_of([&] {
      TextChunks chunks(dir / name, 4096);
      std::string chunk;
      while (chunks.next(chunk)) {
      }
    });
    EXPECT_NE(error.find(dir / name), std::string::npos) << error;
    EXPECT_NE(error.find("truncated"), std::string::npos) << error;
  }
}

TEST(TextSource, MalformedJsonlLinesAreRefusedNamingTheLine) {
  TempDir dir;
  auto error_reading = [&](const std::string& content) {
    noloco::testing::write_text(dir / "d.jsonl", content);
    return error_of([&] {
      DocumentReader reader(dir / "d.jsonl", 4096, "text", "");
      DocumentPiece piece;
      while (reader.next(piece)) {
      }
    });
  };
  EXPECT_NE(error_reading("{\"text\": \"a\"}\n{\"body\": \"b\"}\n").find("d.jsonl:2: no string field 'text'"),
            std::string::npos);
  EXPECT_NE(error_reading("{\"text\": \"a\"}\n\n{\"text\": 3}\n").find("d.jsonl:3: no string field 'text'"),
            std::string::npos);
  const auto utf8 = error_reading("{\"text\": \"a\"}\n{\"text\": \"b\"}\n{\"text\": \"\xff\xfe\"}\n");
  EXPECT_NE(utf8.find("d.jsonl:3: not a JSON line"), std::string::npos) << utf8;
  EXPECT_NE(utf8.find("UTF-8"), std::string::npos) << utf8;
  EXPECT_NE(error_reading("{\"text\": \"a\"\n").find("d.jsonl:1: not a JSON line"), std::string::npos);
  // Found by fuzz_documents: a number past double's range is nlohmann's out_of_range, not a parse error.
  EXPECT_NE(error_reading("{\"text\": \"a\", \"n\": 2.2e2222224444}\n").find("d.jsonl:1: not a JSON line"),
            std::string::npos);
  EXPECT_EQ(error_reading("{\"text\": \"a\"}\n{\"text\": \"\"}\n"), "(no error)");
}

// The acceptance's identity: the same documents as JSONL (plain, gzip, zstd)
// and as plain text separated by the tokenizer's end-of-text marker give
// byte-identical shards, each document followed by the end-of-text id.
TEST(Prepare, JsonlCompressedAndPlainTextOfTheSameDocumentsGiveIdenticalShards) {
  TempDir dir;
  fs::create_directories(dir / "tok");
  noloco::testing::write_text(dir / "tok/tokenizer.json", noloco::testing::gpt2_style().dump());
  const auto text = noloco::testing::shakespeare(120000);
  std::vector<std::string> documents;
  for (size_t at = 0, n = 0; at < text.size(); ++n) {
    const size_t size = n % 7 == 3 ? 9000 : 300 + (n * 977) % 2500;  // a few longer than a chunk
    documents.push_back(text.substr(at, size));
    at += size;
  }
  std::string jsonl, plain;
  for (size_t i = 0; i < documents.size(); ++i) {
    jsonl += nlohmann::json{{"id", i}, {"text", documents[i]}}.dump() + "\n";
    plain += documents[i] + "<|endoftext|>";
  }
  noloco::testing::write_text(dir / "docs.jsonl", jsonl);
  noloco::testing::write_text(dir / "docs.txt", plain);
  gzFile gz = gzopen((dir / "docs.jsonl.gz").c_str(), "wb");
  gzwrite(gz, jsonl.data(), unsigned(jsonl.size()));
  gzclose(gz);
  std::string zst(ZSTD_compressBound(jsonl.size()), '\0');
  zst.resize(ZSTD_compress(zst.data(), zst.size(), jsonl.data(), jsonl.size(), 3));
  noloco::testing::write_text(dir / "docs.jsonl.zst", zst);

  std::map<std::string, std::vector<std::string>> shards;
  for (const std::string input : {"docs.txt", "docs.jsonl", "docs.jsonl.gz", "docs.jsonl.zst"}) {
    PrepareOptions o;
    o.inputs = {dir / input};
    o.out = dir / ("out_" + input);
    o.tokenizer = dir / "tok";
    o.chunk_bytes = 8192;
    o.shard_tokens = 20000;
    const auto r = prepare_corpus(o);
    EXPECT_EQ(r.documents, int64_t(documents.size())) << input;
    const auto train = token_files(o.out), val = validation_files_beside(o.out);
    EXPECT_GT(train.size(), 2u) << input;
    std::vector<int32_t> all;
    for (const auto& f : train) {
      shards[input].push_back(noloco::testing::read_text(f));
      const auto ids = read_token_file(f);
      all.insert(all.end(), ids.begin(), ids.end());
    }
    for (const auto& f : val) {
      shards[input].push_back(noloco::testing::read_text(f));
      const auto ids = read_token_file(f);
      all.insert(all.end(), ids.begin(), ids.end());
    }
    EXPECT_EQ(std::count(all.begin(), all.end(), 260), int64_t(documents.size())) << input;  // <|endoftext|>
  }
  EXPECT_EQ(shards["docs.jsonl"], shards["docs.txt"]);
  EXPECT_EQ(shards["docs.jsonl.gz"], shards["docs.txt"]);
  EXPECT_EQ(shards["docs.jsonl.zst"], shards["docs.txt"]);
}

TEST(Corpus, TextIsTokenizedOncePerRunIntoTheRunDirectory) {
  TempDir dir;
  const auto text = noloco::testing::shakespeare(30000);
  noloco::testing::write_text(dir / "c.txt", text);
  TrainConfig c;
  c.data.path = dir / "c.txt";
  const auto corpus = load_corpus(c.data, 64, dir / "run");
  const auto shard = dir / "run/tokens/text_000000.bin";
  ASSERT_TRUE(fs::exists(shard));
  const auto ids = corpus.tokenizer->encode(text);
  std::vector<int64_t> all(read_all(corpus.train));
  const auto val = read_all(corpus.val);
  all.insert(all.end(), val.begin(), val.end());
  EXPECT_EQ(all, std::vector<int64_t>(ids.begin(), ids.end()));
  // Without a run directory the same ids are held in memory.
  EXPECT_EQ(read_all(load_corpus(c.data, 64, "").train), read_all(corpus.train));

  // A second worker (or a resume) maps what the first wrote.
  const auto written = fs::last_write_time(shard);
  load_corpus(c.data, 64, dir / "run");
  EXPECT_EQ(fs::last_write_time(shard), written);
  // A changed text is encoded anew.
  noloco::testing::write_text(dir / "c.txt", text + text.substr(0, 1000));
  EXPECT_EQ(load_corpus(c.data, 64, dir / "run").train.size() + load_corpus(c.data, 64, dir / "run").val.size(),
            int64_t(ids.size()) + 1000);
}

TEST(Corpus, APreparedDirectoryBringsItsValidationShardsAndTokenizer) {
  TempDir dir;
  noloco::testing::write_text(dir / "c.txt", noloco::testing::shakespeare(60000));
  PrepareOptions o;
  o.inputs = {dir / "c.txt"};
  o.out = dir / "tokens";
  o.vocab_size = 400;
  o.shard_tokens = 5000;
  const auto r = prepare_corpus(o);
  EXPECT_GT(r.train_shards, 2);
  TrainConfig c;
  c.data.path = dir / "tokens";
  const auto corpus = load_corpus(c.data, 64, dir / "run");
  EXPECT_EQ(corpus.tokenizer->kind(), "sentencepiece");
  EXPECT_EQ(corpus.tokenizer->vocab_size(), 400);
  EXPECT_EQ(corpus.tokenizer_source, dir / "tokens") << "the run's config.yaml would name another tokenizer";
  EXPECT_EQ(corpus.train.size(), r.train_tokens);
  EXPECT_EQ(corpus.val.size(), r.val_tokens);

  // Prepared again with nothing held out: the earlier validation shards go, and
  // the run takes its own val_fraction, or with 0 trains without validation.
  o.val_fraction = 0;
  const auto whole = prepare_corpus(o);
  EXPECT_EQ(whole.val_tokens, 0);
  EXPECT_EQ(whole.val_shards, 0);
  EXPECT_FALSE(std::filesystem::exists(dir / "tokens/val_000000.bin"));
  const auto tail = load_corpus(c.data, 64, dir / "run_tail");
  EXPECT_TRUE(tail.validates);
  EXPECT_EQ(tail.val.size(), int64_t(double(whole.train_tokens) * c.data.val_fraction));
  c.data.val_fraction = 0;
  const auto unvalidated = load_corpus(c.data, 64, dir / "run_unvalidated");
  EXPECT_FALSE(unvalidated.validates);
  EXPECT_EQ(unvalidated.train.size(), whole.train_tokens);
  EXPECT_EQ(unvalidated.val.size(), 0);
}

// A lone shard whose magic is flipped used to be read as bare ids, header
// included; now only raw_tokens=true reads a file without llm.c's header.
TEST(Shards, ALoneShardWithAnUnknownMagicIsRefusedUnlessSaidRaw) {
  TempDir dir;
  fs::create_directories(dir / "set");
  write_token_file(dir / "set/train_000000.bin", sequence(2000, 300), 300);
  auto bytes = noloco::testing::read_text(dir / "set/train_000000.bin");
  bytes[0] = 'X';
  noloco::testing::write_text(dir / "set/train_000000.bin", bytes);
  TrainConfig c;
  c.data.path = dir / "set";
  c.data.vocab_size = 65536;
  const auto error = error_of([&] { load_corpus(c.data, 32, ""); });
  EXPECT_NE(error.find(dir / "set/train_000000.bin"), std::string::npos) << error;
  EXPECT_NE(error.find("unknown magic " + std::to_string((20240520 & ~0xff) | 'X')), std::string::npos) << error;
  EXPECT_NE(error.find("raw_tokens=true"), std::string::npos) << error;
  c.data.raw_tokens = true;
  EXPECT_EQ(load_corpus(c.data, 32, "").train.size() + load_corpus(c.data, 32, "").val.size(),
            int64_t(bytes.size() / 2));
}

// A resume maps the shards the run started on: one deleted, replaced or added
// is refused naming it (the promise of a bit-identical resume rests on it);
// accept_changed_data=true goes on and records the new set.
TEST(Corpus, AResumeOverChangedShardsIsRefusedNamingTheChange) {
  TempDir dir;
  const auto ids = sequence(20000, 300);
  fs::create_directories(dir / "set");
  write_shards(dir / "set", "train", ids, 5000, 300);
  TrainConfig c;
  c.data.path = dir / "set";
  const std::string run = dir / "run";
  load_corpus(c.data, 32, run);
  EXPECT_NO_THROW(load_corpus(c.data, 32, run, /*resuming=*/true));
  const auto refusal = [&] { return error_of([&] { load_corpus(c.data, 32, run, true); }); };
  fs::remove(dir / "set/train_000003.bin");
  auto error = refusal();
  EXPECT_NE(error.find("training shard train_000003.bin (11024 bytes, 5000 ids) is gone"), std::string::npos) << error;
  EXPECT_NE(error.find("accept_changed_data=true"), std::string::npos) << error;
  EXPECT_EQ(error.find('\n'), std::string::npos) << error;
  write_token_file(dir / "set/train_000003.bin", std::vector<int32_t>(ids.begin(), ids.begin() + 4000), 300);
  error = refusal();
  EXPECT_NE(error.find("train_000003.bin was 11024 bytes, 5000 ids, is now 9024 bytes, 4000 ids"), std::string::npos)
      << error;
  // Issue 83: another shard of the same size (another corpus prepared with a fixed shard size) was resumed over.
  write_token_file(dir / "set/train_000003.bin", std::vector<int32_t>(ids.begin(), ids.begin() + 5000), 300);
  error = refusal();
  EXPECT_NE(error.find("training shard train_000003.bin holds other tokens at the same size (CRC-32C"),
            std::string::npos)
      << error;
  write_token_file(dir / "set/train_000003.bin", std::vector<int32_t>(ids.begin() + 15000, ids.end()), 300);
  EXPECT_NO_THROW(load_corpus(c.data, 32, run, true)) << "the same tokens again, written anew";
  // Issue 100 item 7: a shard swapped for one of the same size, its modification time put back
  // (`touch -r`), was resumed over: the checksum was trusted for its size and time.
  const auto kept_time = fs::last_write_time(dir / "set/train_000003.bin");
  write_token_file(dir / "set/train_000003.bin", std::vector<int32_t>(ids.begin(), ids.begin() + 5000), 300);
  fs::last_write_time(dir / "set/train_000003.bin", kept_time);
  EXPECT_NE(refusal().find("training shard train_000003.bin holds other tokens at the same size"), std::string::npos);
  write_token_file(dir / "set/train_000003.bin", std::vector<int32_t>(ids.begin() + 15000, ids.end()), 300);
  write_token_file(dir / "set/train_000004.bin", std::vector<int32_t>(ids.begin(), ids.begin() + 100), 300);
  EXPECT_NE(refusal().find("training shard train_000004.bin (1224 bytes, 100 ids) is new"), std::string::npos);
  c.data.accept_changed_data = true;
  EXPECT_NO_THROW(load_corpus(c.data, 32, run, true));
  c.data.accept_changed_data = false;
  EXPECT_NO_THROW(load_corpus(c.data, 32, run, true)) << "the accepted set is the run's now";
  fs::remove(dir / "set/train_000004.bin");
  EXPECT_NO_THROW(load_corpus(c.data, 32, run, false)) << "a fresh start records its own set";
}
