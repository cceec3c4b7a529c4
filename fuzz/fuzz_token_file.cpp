// libFuzzer target: pre-tokenized uint16 token files (llm.c header or raw).
#include <cstdint>
#include <stdexcept>
#include <string>

#include "data/token_file.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    noloco::parse_token_file(std::string(reinterpret_cast<const char*>(data), size));
  } catch (const std::runtime_error&) {
  }
  return 0;
}
