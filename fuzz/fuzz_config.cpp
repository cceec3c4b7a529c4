// libFuzzer target: YAML config text. Any input must give a config or a
// std::invalid_argument / std::runtime_error, never a crash or a hang.
#include <cstdint>
#include <stdexcept>
#include <string>

#include "config/train_config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  try {
    noloco::parse_config(text, {});
  } catch (const std::invalid_argument&) {
  } catch (const std::runtime_error&) {
  }
  return 0;
}
