// Pre-tokenized uint16 token files: llm.c's layout (256 int32 header with
// magic 20240520, version 1, token count) or nanoGPT's raw uint16 array.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace noloco {

// Throws std::runtime_error with a one-line reason on a malformed file.
std::vector<uint16_t> parse_token_file(const std::string& bytes);
std::vector<uint16_t> read_token_file(const std::string& path);
// Writes llm.c's layout.
void write_token_file(const std::string& path, const std::vector<uint16_t>& tokens);

}  // namespace noloco
