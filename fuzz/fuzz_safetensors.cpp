// libFuzzer target: safetensors files (header length, JSON header, offsets).
#include <cstdint>
#include <stdexcept>
#include <string>

#include "util/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    auto file = noloco::parse_safetensors(std::string(reinterpret_cast<const char*>(data), size));
    // Touch every byte the parser vouched for: out-of-bounds views would trip ASan here.
    size_t sum = 0;
    for (auto& [name, t] : file.tensors)
      for (char c : t.data) sum += uint8_t(c);
    volatile size_t sink = sum;
    (void)sink;
  } catch (const std::runtime_error&) {
  }
  return 0;
}
