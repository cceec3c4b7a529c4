#include "data/token_file.h"

#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstdint>
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

namespace {
std::string token_file_header(int64_t tokens) {
  std::string out(kHeaderBytes, '\0');
  const int32_t header[3] = {kMagic, 1, int32_t(tokens)};
  for (int h = 0; h < 3; ++h)
    for (int i = 0; i < 4; ++i) out[size_t(h * 4 + i)] = char((uint32_t(header[h]) >> (8 * i)) & 0xff);
  return out;
}
}  // namespace

void write_token_file(const std::string& path, const std::vector<uint16_t>& tokens) {
  std::string out = token_file_header(int64_t(tokens.size()));
  for (auto t : tokens) {
    out.push_back(char(t & 0xff));
    out.push_back(char(t >> 8));
  }
  write_file_atomic(path, out);
}

TokenFileWriter::TokenFileWriter(std::string path) : path_(std::move(path)), tmp_(path_ + ".tmp") {
  file_ = std::fopen(tmp_.c_str(), "wb");
  if (!file_) throw std::runtime_error(fmt::format("cannot write {}: {}", tmp_, std::strerror(errno)));
  const auto header = token_file_header(0);
  if (std::fwrite(header.data(), 1, header.size(), file_) != header.size())
    throw std::runtime_error(fmt::format("cannot write {}: {}", tmp_, std::strerror(errno)));
}

TokenFileWriter::~TokenFileWriter() {
  if (!file_) return;
  std::fclose(file_);
  std::remove(tmp_.c_str());
}

void TokenFileWriter::append(const std::vector<int32_t>& ids, size_t first, size_t count) {
  // The header counts tokens in an int32.
  if (count_ + int64_t(count) > int64_t(INT32_MAX))
    throw std::runtime_error(fmt::format("{}: more than {} tokens do not fit one token file", path_, INT32_MAX));
  std::string bytes(2 * count, '\0');
  for (size_t i = 0; i < count; ++i) {
    const int32_t id = ids[first + i];
    if (id < 0 || id > 65535) throw std::runtime_error(fmt::format("{}: token id {} does not fit uint16", path_, id));
    bytes[2 * i] = char(id & 0xff);
    bytes[2 * i + 1] = char(id >> 8);
  }
  if (std::fwrite(bytes.data(), 1, bytes.size(), file_) != bytes.size())
    throw std::runtime_error(fmt::format("cannot write {}: {}", tmp_, std::strerror(errno)));
  count_ += int64_t(count);
}

void TokenFileWriter::finish() {
  const auto header = token_file_header(count_);
  const bool ok = std::fseek(file_, 0, SEEK_SET) == 0 && std::fwrite(header.data(), 1, 12, file_) == 12 &&
                  std::fflush(file_) == 0 && ::fsync(::fileno(file_)) == 0;
  const bool closed = std::fclose(file_) == 0;
  file_ = nullptr;
  if (!ok || !closed || std::rename(tmp_.c_str(), path_.c_str()) != 0) {
    std::remove(tmp_.c_str());
    throw std::runtime_error(fmt::format("cannot write {}: {}", path_, std::strerror(errno)));
  }
}

}  // namespace noloco
