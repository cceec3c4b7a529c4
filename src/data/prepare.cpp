#include "data/prepare.h"

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <future>
#include <stdexcept>
#include <thread>

#include <fmt/format.h>

#include "data/token_file.h"
#include "data/tokenizer.h"
#include "util/human.h"
#include "util/progress.h"

namespace noloco {

namespace fs = std::filesystem;

namespace {

// Regular files of the inputs, directories searched recursively (hidden
// entries skipped), each in sorted order so a run is reproducible.
std::vector<std::string> input_files(const std::vector<std::string>& inputs) {
  std::vector<std::string> files;
  for (const auto& input : inputs) {
    if (fs::is_regular_file(input)) {
      files.push_back(input);
    } else if (fs::is_directory(input)) {
      std::vector<std::string> found;
      for (auto it = fs::recursive_directory_iterator(input); it != fs::recursive_directory_iterator(); ++it) {
        if (it->path().filename().string().rfind('.', 0) == 0) {
          if (it->is_directory()) it.disable_recursion_pending();
          continue;
        }
        if (it->is_regular_file()) found.push_back(it->path().string());
      }
      std::sort(found.begin(), found.end());
      files.insert(files.end(), found.begin(), found.end());
    } else {
      throw std::invalid_argument(fmt::format("input '{}' is neither a file nor a directory", input));
    }
  }
  if (files.empty()) throw std::invalid_argument("no input files to prepare");
  return files;
}

// Where to cut `text` so the first part is at most `limit` bytes: after its
// last line end, else before the character that straddles the limit.
size_t cut_point(const std::string& text, size_t limit) {
  if (text.size() <= limit) return text.size();
  const auto newline = text.rfind('\n', limit - 1);
  if (newline != std::string::npos) return newline + 1;
  size_t cut = limit;
  while (cut > limit - std::min<size_t>(limit, 3) && (uint8_t(text[cut]) & 0xc0) == 0x80) --cut;
  return cut == 0 ? limit : cut;
}

// sentencepiece's BPE slows down on long inputs (measured on Tiny Shakespeare:
// 0.6 MB/s in 4 MiB pieces, 1.7 MB/s in 64 KiB, 2.6 MB/s in 8 KiB), so a
// chunk is encoded in line-aligned pieces of about this size, spread over threads.
constexpr size_t kPieceBytes = 8 << 10;

std::vector<int32_t> encode_chunk(const Tokenizer& tokenizer, const std::string& chunk, int threads) {
  std::vector<std::pair<size_t, size_t>> pieces;
  for (size_t at = 0; at < chunk.size();) {
    const size_t n = cut_point(chunk.substr(at, kPieceBytes + 1), kPieceBytes);
    pieces.emplace_back(at, n);
    at += n;
  }
  const size_t groups = std::max<size_t>(1, std::min<size_t>(size_t(threads), pieces.size()));
  std::vector<std::future<std::vector<int32_t>>> parts;
  for (size_t g = 0; g < groups; ++g) {
    const size_t first = pieces.size() * g / groups, end = pieces.size() * (g + 1) / groups;
    parts.push_back(std::async(std::launch::async, [&, first, end] {
      std::vector<int32_t> ids;
      for (size_t p = first; p < end; ++p) {
        const auto piece = tokenizer.encode(chunk.substr(pieces[p].first, pieces[p].second));
        ids.insert(ids.end(), piece.begin(), piece.end());
      }
      return ids;
    }));
  }
  std::vector<int32_t> ids;
  for (auto& part : parts) {
    const auto piece = part.get();
    ids.insert(ids.end(), piece.begin(), piece.end());
  }
  return ids;
}

}  // namespace

PrepareResult prepare_corpus(const PrepareOptions& o) {
  if (o.out.empty()) throw std::invalid_argument("prepare needs out=DIR");
  if (!(o.val_fraction > 0 && o.val_fraction < 1))
    throw std::invalid_argument(fmt::format("val_fraction must be in (0, 1), got {}", o.val_fraction));
  if (o.chunk_bytes < 1024) throw std::invalid_argument("chunk_bytes must be >= 1024");
  const auto start = std::chrono::steady_clock::now();
  const auto files = input_files(o.inputs);
  PrepareResult r;
  r.files = int64_t(files.size());
  for (const auto& f : files) r.bytes += int64_t(fs::file_size(f));

  std::unique_ptr<Tokenizer> tokenizer;
  if (o.tokenizer == "bpe") {
    if (o.vocab_size < 260 || o.vocab_size > 65536)
      throw std::invalid_argument(fmt::format("vocab_size must be in [260, 65536] for bpe, got {}", o.vocab_size));
    fmt::print("training a {}-token BPE tokenizer on {} file(s)\n", o.vocab_size, files.size());
    tokenizer = train_bpe_tokenizer(files, o.vocab_size);
  } else if (o.tokenizer == "char") {
    throw std::invalid_argument("prepare takes tokenizer=bpe, a sentencepiece .model or a directory holding one "
                                "(a char vocabulary is built from the text at training time: give data=FILE.txt)");
  } else {
    tokenizer = open_tokenizer(o.tokenizer);  // a .model file, or a directory (tokenizer.model or tokenizer.json)
  }
  r.vocab_size = tokenizer->vocab_size();
  fs::create_directories(o.out);
  tokenizer->save(o.out);

  const bool wide = r.vocab_size > 65536;  // uint32 ids past uint16's range
  TokenFileWriter train(o.out + "/train.bin", wide), val(o.out + "/val.bin", wide);
  const auto tokenizing = std::chrono::steady_clock::now();  // throughput without the tokenizer's training
  Progress progress("tokenizing", r.bytes);
  int64_t done = 0;
  const int threads = std::max(1, int(std::thread::hardware_concurrency()));
  auto encode = [&](const std::string& text) {
    const auto ids = encode_chunk(*tokenizer, text, threads);
    const auto held_out = size_t(double(ids.size()) * o.val_fraction);
    train.append(ids, 0, ids.size() - held_out);
    val.append(ids, ids.size() - held_out, held_out);
    done += int64_t(text.size());
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - tokenizing).count();
    progress.update(done, fmt::format("{:.1f} MB/s, {} tokens/s", double(done) / 1e6 / std::max(s, 1e-9),
                                      format_count(double(train.tokens() + val.tokens()) / std::max(s, 1e-9))));
  };
  std::string buffer(size_t(o.chunk_bytes), '\0');
  for (const auto& path : files) {
    std::ifstream in(path, std::ios::binary);
    if (!in) throw std::runtime_error(fmt::format("cannot read {}", path));
    std::string pending;
    while (in) {
      in.read(buffer.data(), std::streamsize(buffer.size()));
      pending.append(buffer.data(), size_t(in.gcount()));
      if (pending.size() < size_t(o.chunk_bytes) && in) continue;
      // Tokens do not straddle chunks: cut at a line end.
      const size_t cut = in ? cut_point(pending, size_t(o.chunk_bytes)) : pending.size();
      encode(pending.substr(0, cut));
      pending.erase(0, cut);
    }
    if (in.bad()) throw std::runtime_error(fmt::format("error reading {}", path));
    if (!pending.empty()) encode(pending);
  }
  train.finish();
  val.finish();
  r.train_tokens = train.tokens();
  r.val_tokens = val.tokens();
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  r.tokenize_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - tokenizing).count();
  return r;
}

}  // namespace noloco
