#include "data/token_stream.h"

#include <fcntl.h>
#include <glob.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <stdexcept>

#include <fmt/format.h>

#include "data/token_file.h"
#include "util/files.h"

namespace noloco {

namespace fs = std::filesystem;

struct TokenStream::Files {
  struct File {
    std::string name;
    const uint8_t* ids = nullptr;  // first id
    int64_t count = 0;
    int width = 2;
    void* mapping = nullptr;  // what to unmap; null for ids held in memory
    size_t mapped = 0;
  };
  std::vector<File> files;
  std::vector<int64_t> starts;  // of each file in the stream, then the total
  std::vector<int32_t> held;    // ids held in memory (width 4)
  int64_t vocab = 0;

  Files() = default;
  Files(const Files&) = delete;
  Files& operator=(const Files&) = delete;
  ~Files() {
    for (const auto& f : files)
      if (f.mapping) ::munmap(f.mapping, f.mapped);
  }
  void index() {
    starts.assign(1, 0);
    for (const auto& f : files) starts.push_back(starts.back() + f.count);
  }
};

namespace {

using File = TokenStream::Files::File;

File map_file(const std::string& path, bool raw, int64_t& vocab) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw std::runtime_error(fmt::format("cannot read {}: {}", path, std::strerror(errno)));
  struct stat st {};
  if (::fstat(fd, &st) != 0 || st.st_size == 0) {
    ::close(fd);
    throw std::runtime_error(fmt::format("{}: {}", path, st.st_size == 0 ? "empty token file" : std::strerror(errno)));
  }
  void* mapping = ::mmap(nullptr, size_t(st.st_size), PROT_READ, MAP_SHARED, fd, 0);
  ::close(fd);
  if (mapping == MAP_FAILED) throw std::runtime_error(fmt::format("cannot map {}: {}", path, std::strerror(errno)));
  // Windows are scattered: read-ahead would fill memory with pages no window asks for.
  ::madvise(mapping, size_t(st.st_size), MADV_RANDOM);
  File f{path, nullptr, 0, 2, mapping, size_t(st.st_size)};
  try {
    const auto layout = parse_token_layout(static_cast<const uint8_t*>(mapping), f.mapped, raw);
    f.ids = static_cast<const uint8_t*>(mapping) + layout.offset, f.count = layout.count, f.width = layout.width;
    if (layout.vocab != 0 && vocab != 0 && layout.vocab != vocab)
      throw std::runtime_error(
          fmt::format("declares a vocabulary of {} where the shards before it declare {}", layout.vocab, vocab));
    if (layout.vocab != 0) vocab = layout.vocab;
  } catch (const std::runtime_error& e) {
    ::munmap(mapping, f.mapped);
    throw std::runtime_error(fmt::format("{}: {}", path, e.what()));
  }
  return f;
}

// Unmaps what reading [at, at + bytes) mapped into this process; the pages
// stay in the page cache for the next window and the other workers. Without
// it a worker's resident set grows with the corpus: Linux maps a whole large
// page-cache folio (up to 2 MiB) on one fault, so each window added up to
// 2 MiB (measured: 8 workers on 8 GB of shards, 50 steps, 1138 MiB a worker
// against 274 MiB on 1 MB).
void release(const File& f, const uint8_t* at, size_t bytes) {
  constexpr size_t kFolio = size_t(2) << 20;
  const auto* base = static_cast<const uint8_t*>(f.mapping);
  const size_t from = size_t(at - base) / kFolio * kFolio;
  const size_t to = std::min(f.mapped, (size_t(at - base) + bytes + kFolio - 1) / kFolio * kFolio);
  ::madvise(const_cast<uint8_t*>(base) + from, to - from, MADV_DONTNEED);
}

}  // namespace

TokenStream TokenStream::map_files(const std::vector<std::string>& paths, bool raw) {
  auto files = std::make_shared<Files>();
  for (const auto& path : paths) {
    files->files.push_back(map_file(path, raw, files->vocab));
    const auto& f = files->files.back();
    if (f.width != files->files.front().width)
      throw std::runtime_error(fmt::format("{}: uint{} ids where {} holds uint{}: a shard set has one id width", path,
                                           8 * f.width, files->files.front().name, 8 * files->files.front().width));
  }
  files->index();
  TokenStream s;
  s.end_ = files->starts.back();
  s.files_ = std::move(files);
  return s;
}

TokenStream TokenStream::hold(std::vector<int32_t> ids, std::string name) {
  auto files = std::make_shared<Files>();
  files->held = std::move(ids);
  files->files.push_back({std::move(name), reinterpret_cast<const uint8_t*>(files->held.data()),
                          int64_t(files->held.size()), 4, nullptr, 0});
  files->index();
  TokenStream s;
  s.end_ = files->starts.back();
  s.files_ = std::move(files);
  return s;
}

TokenStream TokenStream::slice(int64_t begin, int64_t end) const {
  if (begin < 0 || end < begin || end > size())
    throw std::out_of_range(fmt::format("tokens [{}, {}) of a stream of {}", begin, end, size()));
  TokenStream s = *this;
  s.begin_ = begin_ + begin;
  s.end_ = begin_ + end;
  return s;
}

int64_t TokenStream::declared_vocab() const { return files_ ? files_->vocab : 0; }

std::vector<TokenStream::FileIdentity> TokenStream::file_identities() const {
  std::vector<FileIdentity> out;
  if (files_)
    for (const auto& f : files_->files)
      if (f.mapping) out.push_back({fs::path(f.name).filename().string(), f.name, int64_t(f.mapped), f.count});
  return out;
}

void TokenStream::read(int64_t at, int64_t count, int64_t* out) const {
  if (at < 0 || count < 0 || at + count > size())
    throw std::out_of_range(fmt::format("tokens [{}, {}) of a stream of {}", at, at + count, size()));
  int64_t pos = begin_ + at;
  const auto& starts = files_->starts;
  size_t f = size_t(std::upper_bound(starts.begin(), starts.end(), pos) - starts.begin()) - 1;
  while (count > 0) {
    const auto& file = files_->files[f];
    const int64_t first = pos - starts[f], n = std::min(count, file.count - first);
    const uint8_t* p = file.ids + first * file.width;
    if (file.width == 2) {
      for (int64_t i = 0; i < n; ++i) out[i] = int64_t(p[2 * i] | (p[2 * i + 1] << 8));
    } else {
      for (int64_t i = 0; i < n; ++i)
        out[i] = int64_t(uint32_t(p[4 * i]) | (uint32_t(p[4 * i + 1]) << 8) | (uint32_t(p[4 * i + 2]) << 16) |
                         (uint32_t(p[4 * i + 3]) << 24));
    }
    if (vocab_limit_ > 0)
      for (int64_t i = 0; i < n; ++i)
        if (out[i] >= vocab_limit_)
          throw std::invalid_argument(fmt::format("'{}' holds token id {} outside the vocabulary of {} (its token {})",
                                                  file.name, out[i], vocab_limit_, first + i));
    if (file.mapping) release(file, p, size_t(n * file.width));
    out += n, pos += n, count -= n, ++f;
  }
}

void TokenStream::check_ids() const {
  std::vector<int64_t> block(size_t(1) << 20);
  for (int64_t at = 0; at < size(); at += int64_t(block.size()))
    read(at, std::min<int64_t>(int64_t(block.size()), size() - at), block.data());
}

namespace {

bool is_glob(const std::string& spec) { return spec.find_first_of("*?[") != std::string::npos; }

std::vector<std::string> glob_files(const std::string& pattern) {
  glob_t g{};
  const int rc = ::glob(pattern.c_str(), 0, nullptr, &g);
  std::vector<std::string> files;
  if (rc == 0)
    for (size_t i = 0; i < g.gl_pathc; ++i)
      if (fs::is_regular_file(g.gl_pathv[i])) files.emplace_back(g.gl_pathv[i]);
  ::globfree(&g);
  std::sort(files.begin(), files.end());
  return files;
}

}  // namespace

bool names_token_files(const std::string& spec) {
  return ends_with(spec, ".bin") || is_glob(spec) || fs::is_directory(spec);
}

std::vector<std::string> token_files(const std::string& spec) {
  std::vector<std::string> files;
  if (is_glob(spec) && !fs::exists(spec)) {
    files = glob_files(spec);
  } else if (fs::is_directory(spec)) {
    files = glob_files(spec + "/*train*.bin");
    if (files.empty()) files = glob_files(spec + "/*.bin");
  } else {
    if (!fs::exists(spec)) throw std::invalid_argument(fmt::format("cannot open '{}': no such file", spec));
    files = {spec};
  }
  if (files.empty())
    throw std::invalid_argument(fmt::format("'{}' names no token files (.bin shards)", spec));
  return files;
}

std::vector<std::string> validation_files_beside(const std::string& spec) {
  return fs::is_directory(spec) ? glob_files(spec + "/*val*.bin") : std::vector<std::string>{};
}

}  // namespace noloco
