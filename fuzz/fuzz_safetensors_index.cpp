// The sharded-checkpoint index of a downloaded or exported model directory.
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "util/safetensors_index.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    const auto index = noloco::parse_safetensors_index(std::string(reinterpret_cast<const char*>(data), size));
    for (const auto& file : index.files())
      if (file.find('/') != std::string::npos) __builtin_trap();  // must have been refused
  } catch (const std::runtime_error&) {
  }
  return 0;
}
