// Pre-tokenized token files: llm.c's layout (a 256-int32 header: magic,
// version, token count) with uint16 ids (magic 20240520, version 1) or, for
// vocabularies past 65 536, uint32 ids (magic 20240801, version 7, as llm.c
// writes Llama 3 data); or nanoGPT's raw uint16 array. noloco also writes the
// vocabulary size into the header's fourth int (0: not said), which llm.c's
// readers ignore, so shards of different tokenizers can be told apart.
#pragma once
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

namespace noloco {

// Where a file's ids lie and how wide each is.
struct TokenLayout {
  size_t offset = 0;   // bytes before the first id
  int64_t count = 0;   // ids
  int width = 2;       // bytes an id: 2 (uint16) or 4 (uint32)
  int64_t vocab = 0;   // the vocabulary the writer declared; 0 if none
};

// Reads the header of a whole file of `size` bytes starting at `data`; the
// file must hold exactly the ids its header counts. `allow_raw`: a file
// without llm.c's magic is nanoGPT's raw uint16 array (the user said so:
// raw_tokens=true); else an unknown magic is refused, naming it. Throws
// std::runtime_error with a one-line reason (without the path; callers add it).
TokenLayout parse_token_layout(const uint8_t* data, size_t size, bool allow_raw);
// Throws std::runtime_error with a one-line reason on a malformed file.
std::vector<int32_t> parse_token_file(const std::string& bytes);
std::vector<int32_t> read_token_file(const std::string& path);
// Writes llm.c's layout: uint16 unless an id needs more.
void write_token_file(const std::string& path, const std::vector<int32_t>& tokens, int64_t vocab = 0);

// llm.c's layout written as the tokens arrive, for corpora larger than memory:
// into PATH.tmp, the header's count patched by finish(), then renamed to PATH
// (a file at PATH is always whole). Throws std::runtime_error naming the path.
class TokenFileWriter {
 public:
  // `wide`: uint32 ids (a vocabulary past 65 536), else uint16. `vocab`: the
  // tokenizer's size, written into the header (0: not said).
  TokenFileWriter(std::string path, bool wide, int64_t vocab = 0);
  ~TokenFileWriter();  // without finish(): removes the partial file
  TokenFileWriter(const TokenFileWriter&) = delete;
  TokenFileWriter& operator=(const TokenFileWriter&) = delete;
  // Ids must be >= 0, and < 65 536 unless wide.
  void append(const std::vector<int32_t>& ids, size_t first, size_t count);
  void finish();
  int64_t tokens() const { return count_; }

 private:
  std::string path_, tmp_;
  std::FILE* file_ = nullptr;
  bool wide_;
  int64_t vocab_;
  int64_t count_ = 0;
};

// A set of llm.c shards written in order, PREFIX_000000.bin, PREFIX_000001.bin,
// ..., each of at most `shard_tokens` ids (llm.c's fineweb shards hold 10^8).
// finish() removes shards of the same prefix left by an earlier, longer run,
// so a directory never mixes two preparations. An empty set is one empty
// shard (a reader is told "no tokens", not "no files"), or with
// `empty_shard = false` no shard at all (nothing was meant to be there).
class ShardWriter {
 public:
  ShardWriter(std::string dir, std::string prefix, int64_t shard_tokens, bool wide, int64_t vocab);
  void append(const std::vector<int32_t>& ids, size_t first, size_t count);
  void finish(bool empty_shard = true);
  int64_t tokens() const { return done_ + (file_ ? file_->tokens() : 0); }
  int64_t shards() const { return shards_; }

 private:
  std::string shard_path(int64_t index) const;
  std::string dir_, prefix_;
  int64_t shard_tokens_;
  bool wide_;
  int64_t vocab_;
  std::unique_ptr<TokenFileWriter> file_;
  int64_t shards_ = 0, done_ = 0;
};

}  // namespace noloco
