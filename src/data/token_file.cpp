#include "data/token_file.h"

#include <cstring>
#include <stdexcept>

#include <fmt/format.h>

#include "util/files.h"

namespace noloco {

namespace {
constexpr int32_t kMagic = 20240520;
constexpr size_t kHeaderInts = 256;
constexpr size_t kHeaderBytes = kHeaderInts * sizeof(int32_t);

int32_t read_le32(const std::string& b, size_t index) {
  uint32_t v = 0;
  for (int i = 3; i >= 0; --i) v = (v << 8) | uint8_t(b[index * 4 + size_t(i)]);
  return int32_t(v);
}
}  // namespace

std::vector<uint16_t> parse_token_file(const std::string& bytes) {
  size_t start = 0, count = 0;
  if (bytes.size() >= kHeaderBytes && read_le32(bytes, 0) == kMagic) {
    const int32_t version = read_le32(bytes, 1), n = read_le32(bytes, 2);
    if (version != 1)
      throw std::runtime_error(fmt::format("token file version {} (only 1, uint16, is supported)", version));
    if (n < 0 || size_t(n) > (bytes.size() - kHeaderBytes) / 2)
      throw std::runtime_error(fmt::format("token file header claims {} tokens but holds {}", n,
                                           (bytes.size() - kHeaderBytes) / 2));
    start = kHeaderBytes, count = size_t(n);
  } else {
    if (bytes.size() % 2 != 0) throw std::runtime_error("raw token file has an odd number of bytes");
    count = bytes.size() / 2;
  }
  std::vector<uint16_t> tokens(count);
  for (size_t i = 0; i < count; ++i)
    tokens[i] = uint16_t(uint8_t(bytes[start + 2 * i]) | (uint8_t(bytes[start + 2 * i + 1]) << 8));
  return tokens;
}

std::vector<uint16_t> read_token_file(const std::string& path) {
  try {
    return parse_token_file(read_file(path));
  } catch (const std::runtime_error& e) {
    throw std::runtime_error(fmt::format("{}: {}", path, e.what()));
  }
}

void write_token_file(const std::string& path, const std::vector<uint16_t>& tokens) {
  std::string out(kHeaderBytes, '\0');
  const int32_t header[3] = {kMagic, 1, int32_t(tokens.size())};
  for (int h = 0; h < 3; ++h)
    for (int i = 0; i < 4; ++i) out[size_t(h * 4 + i)] = char((uint32_t(header[h]) >> (8 * i)) & 0xff);
  for (auto t : tokens) {
    out.push_back(char(t & 0xff));
    out.push_back(char(t >> 8));
  }
  write_file_atomic(path, out);
}

}  // namespace noloco
