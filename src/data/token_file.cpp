#include "data/token_file.h"

#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstdint>
#include <cstring>
#include <memory>
#include <algorithm>
#include <stdexcept>

#include <fmt/format.h>

#include "util/files.h"

namespace noloco {

namespace {
// llm.c's headers: uint16 tokens (GPT-2 and other vocabularies up to 65 536),
// and the uint32 tokens its Llama 3 data uses.
constexpr int32_t kMagic16 = 20240520, kVersion16 = 1;
constexpr int32_t kMagic32 = 20240801, kVersion32 = 7;
constexpr size_t kHeaderInts = 256;
constexpr size_t kHeaderBytes = kHeaderInts * sizeof(int32_t);

int32_t read_le32(const uint8_t* b) {
  uint32_t v = 0;
  for (int i = 3; i >= 0; --i) v = (v << 8) | b[i];
  return int32_t(v);
}

std::string token_file_header(int64_t tokens, bool wide, int64_t vocab) {
  std::string out(kHeaderBytes, '\0');
  const int32_t header[4] = {wide ? kMagic32 : kMagic16, wide ? kVersion32 : kVersion16, int32_t(tokens),
                             int32_t(vocab)};
  for (int h = 0; h < 4; ++h)
    for (int i = 0; i < 4; ++i) out[size_t(h * 4 + i)] = char((uint32_t(header[h]) >> (8 * i)) & 0xff);
  return out;
}

void append_ids(std::string& out, const int32_t* ids, size_t count, bool wide) {
  const size_t width = wide ? 4 : 2;
  const size_t at = out.size();
  out.resize(at + width * count);
  for (size_t i = 0; i < count; ++i)
    for (size_t b = 0; b < width; ++b) out[at + width * i + b] = char((uint32_t(ids[i]) >> (8 * b)) & 0xff);
}
}  // namespace

TokenLayout parse_token_layout(const uint8_t* data, size_t size, bool allow_raw) {
  const int32_t magic = size >= kHeaderBytes ? read_le32(data) : 0;
  if (magic != kMagic16 && magic != kMagic32) {
    if (!allow_raw)
      throw std::runtime_error(fmt::format("unknown magic {} (llm.c token shards start with {} for uint16 or {} for "
                                           "uint32 ids; for nanoGPT's bare uint16 ids say raw_tokens=true)",
                                           magic, kMagic16, kMagic32));
    if (size % 2 != 0) throw std::runtime_error("raw token file has an odd number of bytes");
    return {0, int64_t(size / 2), 2, 0};
  }
  const int32_t version = read_le32(data + 4), n = read_le32(data + 8), vocab = read_le32(data + 12);
  TokenLayout layout{kHeaderBytes, n, magic == kMagic32 ? 4 : 2, std::max(vocab, 0)};
  if (version != (magic == kMagic32 ? kVersion32 : kVersion16))
    throw std::runtime_error(fmt::format("token file version {} with magic {} (noloco reads version 1 with {}, "
                                         "uint16, and version 7 with {}, uint32)",
                                         version, magic, kMagic16, kMagic32));
  const size_t body = size - kHeaderBytes, held = body / size_t(layout.width);
  if (n < 0 || size_t(n) != held || body % size_t(layout.width) != 0)
    throw std::runtime_error(fmt::format("token file header claims {} tokens but holds {}{}", n, held,
                                         body % size_t(layout.width) ? " and a partial one" : ""));
  return layout;
}

std::vector<int32_t> parse_token_file(const std::string& bytes) {
  const auto* data = reinterpret_cast<const uint8_t*>(bytes.data());
  const auto layout = parse_token_layout(data, bytes.size(), true);
  std::vector<int32_t> tokens(size_t(layout.count));
  for (size_t i = 0; i < tokens.size(); ++i) {
    const uint8_t* at = data + layout.offset + size_t(layout.width) * i;
    if (layout.width == 2) {
      tokens[i] = int32_t(at[0] | (at[1] << 8));
    } else {
      tokens[i] = read_le32(at);
      if (tokens[i] < 0) throw std::runtime_error(fmt::format("token {} has id {} (beyond 2^31)", i, uint32_t(tokens[i])));
    }
  }
  return tokens;
}

std::vector<int32_t> read_token_file(const std::string& path) {
  try {
    return parse_token_file(read_file(path));
  } catch (const std::runtime_error& e) {
    throw std::runtime_error(fmt::format("{}: {}", path, e.what()));
  }
}

void write_token_file(const std::string& path, const std::vector<int32_t>& tokens, int64_t vocab) {
  bool wide = false;
  for (const int32_t t : tokens) {
    if (t < 0) throw std::runtime_error(fmt::format("{}: token id {} is negative", path, t));
    wide |= t > 65535;
  }
  std::string out = token_file_header(int64_t(tokens.size()), wide, vocab);
  append_ids(out, tokens.data(), tokens.size(), wide);
  write_file_atomic(path, out);
}

TokenFileWriter::TokenFileWriter(std::string path, bool wide, int64_t vocab)
    : path_(std::move(path)), tmp_(path_ + ".tmp"), wide_(wide), vocab_(vocab) {
  file_ = std::fopen(tmp_.c_str(), "wb");
  if (!file_) throw std::runtime_error(fmt::format("cannot write {}: {}", tmp_, std::strerror(errno)));
  const auto header = token_file_header(0, wide_, vocab_);
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
  for (size_t i = 0; i < count; ++i) {
    const int32_t id = ids[first + i];
    if (id < 0 || (!wide_ && id > 65535))
      throw std::runtime_error(fmt::format("{}: token id {} does not fit uint16", path_, id));
  }
  std::string bytes;
  append_ids(bytes, ids.data() + first, count, wide_);
  if (std::fwrite(bytes.data(), 1, bytes.size(), file_) != bytes.size())
    throw std::runtime_error(fmt::format("cannot write {}: {}", tmp_, std::strerror(errno)));
  count_ += int64_t(count);
}

void TokenFileWriter::finish() {
  const auto header = token_file_header(count_, wide_, vocab_);
  const bool ok = std::fseek(file_, 0, SEEK_SET) == 0 && std::fwrite(header.data(), 1, 16, file_) == 16 &&
                  std::fflush(file_) == 0 && ::fsync(::fileno(file_)) == 0;
  const bool closed = std::fclose(file_) == 0;
  file_ = nullptr;
  if (!ok || !closed || std::rename(tmp_.c_str(), path_.c_str()) != 0) {
    std::remove(tmp_.c_str());
    throw std::runtime_error(fmt::format("cannot write {}: {}", path_, std::strerror(errno)));
  }
}

ShardWriter::ShardWriter(std::string dir, std::string prefix, int64_t shard_tokens, bool wide, int64_t vocab)
    : dir_(std::move(dir)), prefix_(std::move(prefix)), shard_tokens_(shard_tokens), wide_(wide), vocab_(vocab) {
  if (shard_tokens_ < 1 || shard_tokens_ > int64_t(INT32_MAX))
    throw std::invalid_argument(fmt::format("shard_tokens must be in [1, {}], got {}", INT32_MAX, shard_tokens_));
}

std::string ShardWriter::shard_path(int64_t index) const {
  return fmt::format("{}/{}_{:06d}.bin", dir_, prefix_, index);
}

void ShardWriter::append(const std::vector<int32_t>& ids, size_t first, size_t count) {
  while (count > 0) {
    if (!file_) file_ = std::make_unique<TokenFileWriter>(shard_path(shards_), wide_, vocab_);
    const size_t room = size_t(shard_tokens_ - file_->tokens()), n = std::min(room, count);
    file_->append(ids, first, n);
    first += n, count -= n;
    if (file_->tokens() == shard_tokens_) {
      file_->finish();
      done_ += shard_tokens_, ++shards_;
      file_.reset();
    }
  }
}

void ShardWriter::finish(bool empty_shard) {
  if (file_ || (shards_ == 0 && empty_shard)) {
    if (!file_) file_ = std::make_unique<TokenFileWriter>(shard_path(shards_), wide_, vocab_);
    done_ += file_->tokens(), ++shards_;
    file_->finish();
    file_.reset();
  }
  for (int64_t stale = shards_; std::remove(shard_path(stale).c_str()) == 0; ++stale) {
  }
}

}  // namespace noloco
