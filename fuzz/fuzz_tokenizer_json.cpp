// libFuzzer target: a Hugging Face tokenizer.json, then a text through it.
// The input is the file, a NUL, and the text to encode (and decode back).
#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "data/byte_level_bpe.h"

namespace {
std::string without_spaces(std::string s) {
  s.erase(std::remove(s.begin(), s.end(), ' '), s.end());
  return s;
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string input(reinterpret_cast<const char*>(data), size);
  const auto nul = input.find('\0');
  try {
    const noloco::ByteLevelBpe tokenizer(input.substr(0, nul), "", "fuzz");
    if (nul != std::string::npos) {
      const auto ids = tokenizer.encode(input.substr(nul + 1));
      // Byte-level BPE is lossless but for the spaces a ByteLevel step with
      // add_prefix_space (true unless the file says otherwise, as in Hugging
      // Face's library) puts in front of pieces: nothing else may differ.
      const auto text = input.substr(nul + 1), decoded = tokenizer.decode(ids);
      if (decoded != text && without_spaces(decoded) != without_spaces(text)) __builtin_trap();
    }
  } catch (const std::runtime_error&) {
  } catch (const std::invalid_argument&) {
  }
  return 0;
}
