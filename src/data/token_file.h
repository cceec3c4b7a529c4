// Pre-tokenized token files: llm.c's layout (a 256-int32 header: magic,
// version, token count) with uint16 ids (magic 20240520, version 1) or, for
// vocabularies past 65 536, uint32 ids (magic 20240801, version 7, as llm.c
// writes Llama 3 data); or nanoGPT's raw uint16 array.
#pragma once
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

namespace noloco {

// Throws std::runtime_error with a one-line reason on a malformed file.
std::vector<int32_t> parse_token_file(const std::string& bytes);
std::vector<int32_t> read_token_file(const std::string& path);
// Writes llm.c's layout: uint16 unless an id needs more.
void write_token_file(const std::string& path, const std::vector<int32_t>& tokens);

// llm.c's layout written as the tokens arrive, for corpora larger than memory:
// into PATH.tmp, the header's count patched by finish(), then renamed to PATH
// (a file at PATH is always whole). Throws std::runtime_error naming the path.
class TokenFileWriter {
 public:
  // `wide`: uint32 ids (a vocabulary past 65 536), else uint16.
  TokenFileWriter(std::string path, bool wide);
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
  int64_t count_ = 0;
};

}  // namespace noloco
