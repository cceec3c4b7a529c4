// Pre-tokenized uint16 token files: llm.c's layout (256 int32 header with
// magic 20240520, version 1, token count) or nanoGPT's raw uint16 array.
#pragma once
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

namespace noloco {

// Throws std::runtime_error with a one-line reason on a malformed file.
std::vector<uint16_t> parse_token_file(const std::string& bytes);
std::vector<uint16_t> read_token_file(const std::string& path);
// Writes llm.c's layout.
void write_token_file(const std::string& path, const std::vector<uint16_t>& tokens);

// llm.c's layout written as the tokens arrive, for corpora larger than memory:
// into PATH.tmp, the header's count patched by finish(), then renamed to PATH
// (a file at PATH is always whole). Throws std::runtime_error naming the path.
class TokenFileWriter {
 public:
  explicit TokenFileWriter(std::string path);
  ~TokenFileWriter();  // without finish(): removes the partial file
  TokenFileWriter(const TokenFileWriter&) = delete;
  TokenFileWriter& operator=(const TokenFileWriter&) = delete;
  // Ids must be in [0, 65535].
  void append(const std::vector<int32_t>& ids, size_t first, size_t count);
  void finish();
  int64_t tokens() const { return count_; }

 private:
  std::string path_, tmp_;
  std::FILE* file_ = nullptr;
  int64_t count_ = 0;
};

}  // namespace noloco
