// libFuzzer target: a Hugging Face tokenizer.json, then a text through it.
// The input is the file, a NUL, and the text to encode (and decode back).
#include <cstdint>
#include <stdexcept>
#include <string>

#include "data/byte_level_bpe.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string input(reinterpret_cast<const char*>(data), size);
  const auto nul = input.find('\0');
  try {
    const noloco::ByteLevelBpe tokenizer(input.substr(0, nul), "", "fuzz");
    if (nul != std::string::npos) {
      const auto ids = tokenizer.encode(input.substr(nul + 1));
      if (tokenizer.decode(ids) != input.substr(nul + 1)) __builtin_trap();  // byte-level BPE is lossless
    }
  } catch (const std::runtime_error&) {
  } catch (const std::invalid_argument&) {
  }
  return 0;
}
