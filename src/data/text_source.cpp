#include "data/text_source.h"

#include <zlib.h>
#include <zstd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "util/files.h"

namespace noloco {

namespace {

class PlainSource : public ByteSource {
 public:
  explicit PlainSource(const std::string& path) : path_(path), file_(std::fopen(path.c_str(), "rb")) {
    if (!file_) throw std::runtime_error(fmt::format("cannot read {}: {}", path, std::strerror(errno)));
  }
  ~PlainSource() override { std::fclose(file_); }
  size_t read(char* out, size_t size) override {
    const size_t n = std::fread(out, 1, size, file_);
    if (n < size && std::ferror(file_)) throw std::runtime_error(fmt::format("error reading {}", path_));
    consumed_ += int64_t(n);
    return n;
  }
  int64_t consumed() const override { return consumed_; }

 private:
  std::string path_;
  std::FILE* file_;
  int64_t consumed_ = 0;
};

class GzipSource : public ByteSource {
 public:
  explicit GzipSource(const std::string& path) : path_(path), file_(gzopen(path.c_str(), "rb")) {
    if (!file_) throw std::runtime_error(fmt::format("cannot read {}: {}", path, std::strerror(errno)));
    gzbuffer(file_, 1 << 20);
  }
  ~GzipSource() override { gzclose(file_); }
  size_t read(char* out, size_t size) override {
    const int n = gzread(file_, out, unsigned(std::min<size_t>(size, 1 << 30)));
    int code = Z_OK;
    const char* message = gzerror(file_, &code);
    if (n < 0 || (code != Z_OK && code != Z_BUF_ERROR))
      throw std::runtime_error(fmt::format("{}: not a valid gzip stream ({})", path_, message));
    // A stream cut short reads to its end without an error from gzread: gzerror says so.
    if (n == 0 && code == Z_BUF_ERROR) throw std::runtime_error(fmt::format("{}: the gzip stream is truncated", path_));
    return size_t(n);
  }
  int64_t consumed() const override { return int64_t(gzoffset(file_)); }

 private:
  std::string path_;
  gzFile file_;
};

class ZstdSource : public ByteSource {
 public:
  explicit ZstdSource(const std::string& path)
      : path_(path), file_(std::fopen(path.c_str(), "rb")), stream_(ZSTD_createDStream()), in_(ZSTD_DStreamInSize()) {
    if (!file_) throw std::runtime_error(fmt::format("cannot read {}: {}", path, std::strerror(errno)));
  }
  ~ZstdSource() override {
    ZSTD_freeDStream(stream_);
    std::fclose(file_);
  }
  size_t read(char* out, size_t size) override {
    ZSTD_outBuffer o{out, size, 0};
    while (o.pos == 0) {
      if (input_.pos == input_.size) {
        const size_t n = std::fread(in_.data(), 1, in_.size(), file_);
        if (n == 0) {
          if (std::ferror(file_)) throw std::runtime_error(fmt::format("error reading {}", path_));
          if (last_ != 0) throw std::runtime_error(fmt::format("{}: the zstd stream is truncated", path_));
          return 0;
        }
        consumed_ += int64_t(n);
        input_ = {in_.data(), n, 0};
      }
      last_ = ZSTD_decompressStream(stream_, &o, &input_);
      if (ZSTD_isError(last_))
        throw std::runtime_error(fmt::format("{}: not a valid zstd stream ({})", path_, ZSTD_getErrorName(last_)));
    }
    return o.pos;
  }
  int64_t consumed() const override { return consumed_; }

 private:
  std::string path_;
  std::FILE* file_;
  ZSTD_DStream* stream_;
  std::vector<char> in_;
  ZSTD_inBuffer input_{nullptr, 0, 0};
  size_t last_ = 0;  // 0 once a frame is complete
  int64_t consumed_ = 0;
};

// The name without its compression suffix.
std::string uncompressed_name(const std::string& path) {
  for (const char* suffix : {".gz", ".zst"})
    if (ends_with(path, suffix)) return path.substr(0, path.size() - std::strlen(suffix));
  return path;
}

constexpr size_t kReadBytes = 1 << 20;
// A JSONL line (one document) is held whole while parsed: a file without line
// ends must not take all memory.
constexpr size_t kLongestLine = size_t(256) << 20;

}  // namespace

std::unique_ptr<ByteSource> open_byte_source(const std::string& path) {
  if (ends_with(path, ".gz")) return std::make_unique<GzipSource>(path);
  if (ends_with(path, ".zst")) return std::make_unique<ZstdSource>(path);
  return std::make_unique<PlainSource>(path);
}

size_t cut_point(const std::string& text, size_t limit) {
  if (text.size() <= limit) return text.size();
  const auto newline = text.rfind('\n', limit - 1);
  if (newline != std::string::npos) return newline + 1;
  size_t cut = limit;
  while (cut > limit - std::min<size_t>(limit, 3) && (uint8_t(text[cut]) & 0xc0) == 0x80) --cut;
  return cut == 0 ? limit : cut;
}

TextChunks::TextChunks(const std::string& path, size_t limit) : source_(open_byte_source(path)), limit_(limit) {}

bool TextChunks::next(std::string& chunk) {
  std::vector<char> buffer(kReadBytes);
  while (!ended_ && pending_.size() <= limit_) {
    const size_t n = source_->read(buffer.data(), buffer.size());
    ended_ = n == 0;
    pending_.append(buffer.data(), n);
  }
  if (pending_.empty()) return false;
  const size_t cut = cut_point(pending_, limit_);
  chunk = pending_.substr(0, cut);
  pending_.erase(0, cut);
  return true;
}

DocumentReader::DocumentReader(const std::string& path, size_t limit, std::string text_field, std::string separator)
    : path_(path),
      source_(open_byte_source(path)),
      limit_(limit),
      field_(std::move(text_field)),
      separator_(std::move(separator)),
      jsonl_(ends_with(uncompressed_name(path), ".jsonl")) {}

DocumentReader::~DocumentReader() = default;

bool DocumentReader::fill() {
  if (ended_) return false;
  if (at_ > 0) {
    buffer_.erase(0, at_);
    at_ = 0;
  }
  const size_t had = buffer_.size();
  buffer_.resize(had + kReadBytes);
  const size_t n = source_->read(buffer_.data() + had, kReadBytes);
  buffer_.resize(had + n);
  ended_ = n == 0;
  return n > 0;
}

bool DocumentReader::next(DocumentPiece& piece) { return jsonl_ ? next_jsonl(piece) : next_text(piece); }

bool DocumentReader::next_jsonl(DocumentPiece& piece) {
  while (document_at_ >= document_.size()) {
    size_t end;
    while ((end = buffer_.find('\n', at_)) == std::string::npos && fill())
      if (buffer_.size() - at_ > kLongestLine)
        throw std::runtime_error(fmt::format("{}:{}: a line longer than {} MiB", path_, line_ + 1, kLongestLine >> 20));
    if (end == std::string::npos && at_ >= buffer_.size()) return false;
    if (end == std::string::npos) end = buffer_.size();
    const std::string line = buffer_.substr(at_, end - at_);
    at_ = std::min(end + 1, buffer_.size());
    ++line_;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(line);
    } catch (const nlohmann::json::exception& e) {  // a syntax error, or a number past double's range
      throw std::runtime_error(fmt::format("{}:{}: not a JSON line ({})", path_, line_, e.what()));
    }
    if (!j.is_object() || !j.contains(field_) || !j[field_].is_string())
      throw std::runtime_error(fmt::format("{}:{}: no string field '{}' (set text_field=)", path_, line_, field_));
    document_ = j[field_].get<std::string>();
    document_at_ = 0;
  }
  const size_t n = cut_point(document_.substr(document_at_, limit_ + 1), limit_);
  piece.text = document_.substr(document_at_, n);
  document_at_ += n;
  piece.ends_document = document_at_ >= document_.size();
  return true;
}

bool DocumentReader::next_text(DocumentPiece& piece) {
  for (;;) {
    // Enough to see whether a separator starts within the next `limit` bytes.
    while (buffer_.size() - at_ < limit_ + separator_.size() + 1 && fill()) {
    }
    if (at_ >= buffer_.size()) return false;
    const size_t found = separator_.empty() ? std::string::npos : buffer_.find(separator_, at_);
    if (found != std::string::npos && found - at_ <= limit_) {
      piece.text = buffer_.substr(at_, found - at_);
      piece.ends_document = true;
      at_ = found + separator_.size();
      if (piece.text.empty()) continue;
      return true;
    }
    const std::string window = buffer_.substr(at_, limit_ + 1);
    const size_t n = cut_point(window, limit_);
    piece.text = window.substr(0, n);
    at_ += n;
    // A file's end ends its last document.
    piece.ends_document = ended_ && at_ >= buffer_.size();
    return true;
  }
}

}  // namespace noloco
