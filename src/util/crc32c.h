// CRC-32C (Castagnoli): TensorBoard's record framing and checkpoint file
// checksums. Uses the SSE4.2 instruction where the CPU has it.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string_view>

namespace noloco {

uint32_t crc32c(std::string_view data);
// Continues a checksum over more bytes: crc32c(a + b) == crc32c_extend(crc32c(a), b).
uint32_t crc32c_extend(uint32_t crc, const void* data, size_t size);

}  // namespace noloco
