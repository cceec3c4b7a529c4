#include "data/prepare.h"

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <future>
#include <stdexcept>
#include <thread>

#include <fmt/format.h>

#include "data/text_source.h"
#include "data/token_file.h"
#include "data/tokenizer.h"
#include "util/files.h"
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

// sentencepiece's BPE slows down on long inputs (measured on Tiny Shakespeare:
// 0.6 MB/s in 4 MiB pieces, 1.7 MB/s in 64 KiB, 2.6 MB/s in 8 KiB), so a
// document is encoded in line-aligned pieces of about this size, spread over threads.
constexpr size_t kPieceBytes = 8 << 10;

// The ids of `documents` in order, each complete document followed by the
// end-of-text id where the tokenizer has one.
std::vector<int32_t> encode_documents(const Tokenizer& tokenizer, const std::vector<DocumentPiece>& documents,
                                      int threads) {
  struct Piece {
    const std::string* text;
    size_t at, size;
    bool ends_document;
  };
  std::vector<Piece> pieces;
  for (const auto& d : documents) {
    for (size_t at = 0; at < d.text.size();) {
      const size_t n = cut_point(d.text.substr(at, kPieceBytes + 1), kPieceBytes);
      pieces.push_back({&d.text, at, n, false});
      at += n;
    }
    if (!pieces.empty() && pieces.back().text == &d.text) pieces.back().ends_document = d.ends_document;
  }
  const auto eot = tokenizer.end_of_text();
  const size_t groups = std::max<size_t>(1, std::min<size_t>(size_t(threads), pieces.size()));
  std::vector<std::future<std::vector<int32_t>>> parts;
  for (size_t g = 0; g < groups; ++g) {
    const size_t first = pieces.size() * g / groups, end = pieces.size() * (g + 1) / groups;
    parts.push_back(std::async(std::launch::async, [&, first, end] {
      std::vector<int32_t> ids;
      for (size_t p = first; p < end; ++p) {
        const auto piece = tokenizer.encode(pieces[p].text->substr(pieces[p].at, pieces[p].size));
        ids.insert(ids.end(), piece.begin(), piece.end());
        if (eot && pieces[p].ends_document) ids.push_back(eot->id);
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

bool is_plain_text(const std::string& path) {
  return !ends_with(path, ".gz") && !ends_with(path, ".zst") && !ends_with(path, ".jsonl");
}

// sentencepiece reads plain text only: from JSONL or compressed inputs it
// trains on a sample of their documents (it samples a million lines anyway).
std::unique_ptr<Tokenizer> train_tokenizer(const std::vector<std::string>& files, const PrepareOptions& o) {
  if (std::all_of(files.begin(), files.end(), is_plain_text)) return train_bpe_tokenizer(files, o.vocab_size);
  const std::string sample = o.out + "/.bpe_sample.txt";
  {
    std::ofstream out(sample, std::ios::binary);
    constexpr int64_t kSampleBytes = int64_t(256) << 20;
    int64_t written = 0;
    for (size_t f = 0; f < files.size() && written < kSampleBytes; ++f) {
      DocumentReader reader(files[f], size_t(o.chunk_bytes), o.text_field, "");
      DocumentPiece piece;
      const int64_t share = (kSampleBytes - written) / int64_t(files.size() - f);
      for (int64_t mine = 0; mine < share && reader.next(piece); mine += int64_t(piece.text.size())) {
        out << piece.text << (piece.ends_document && (piece.text.empty() || piece.text.back() != '\n') ? "\n" : "");
        written += int64_t(piece.text.size());
      }
    }
    if (!out) throw std::runtime_error(fmt::format("cannot write {}", sample));
  }
  auto tokenizer = train_bpe_tokenizer({sample}, o.vocab_size);
  fs::remove(sample);
  return tokenizer;
}

std::unique_ptr<Tokenizer> prepare_tokenizer(const std::vector<std::string>& files, const PrepareOptions& o) {
  if (o.tokenizer == "bpe") {
    if (o.vocab_size < 260 || o.vocab_size > 65536)
      throw std::invalid_argument(fmt::format("vocab_size must be in [260, 65536] for bpe, got {}", o.vocab_size));
    fmt::print("training a {}-token BPE tokenizer on {} file(s)\n", o.vocab_size, files.size());
    return train_tokenizer(files, o);
  }
  if (o.tokenizer == "char")
    throw std::invalid_argument("prepare takes tokenizer=bpe, a sentencepiece .model or a directory holding one "
                                "(a char vocabulary is built from the text at training time: give data=FILE.txt)");
  return open_tokenizer(o.tokenizer);  // a .model file, or a directory (tokenizer.model or tokenizer.json)
}

}  // namespace

PrepareResult prepare_corpus(const PrepareOptions& o) {
  if (o.out.empty()) throw std::invalid_argument("prepare needs out=DIR");
  if (!(o.val_fraction >= 0 && o.val_fraction < 1))
    throw std::invalid_argument(fmt::format("val_fraction must be in [0, 1), got {}", o.val_fraction));
  if (o.chunk_bytes < 1024) throw std::invalid_argument("chunk_bytes must be >= 1024");
  if (o.text_field.empty()) throw std::invalid_argument("text_field must name a field");
  const auto start = std::chrono::steady_clock::now();
  const auto files = input_files(o.inputs);
  PrepareResult r;
  r.files = int64_t(files.size());
  for (const auto& f : files) r.bytes += int64_t(fs::file_size(f));

  fs::create_directories(o.out);
  const auto tokenizer = prepare_tokenizer(files, o);
  r.vocab_size = tokenizer->vocab_size();
  tokenizer->save(o.out);
  const auto eot = tokenizer->end_of_text();

  const bool wide = r.vocab_size > 65536;  // uint32 ids past uint16's range
  ShardWriter train(o.out, "train", o.shard_tokens, wide, r.vocab_size),
      val(o.out, "val", o.shard_tokens, wide, r.vocab_size);
  const auto tokenizing = std::chrono::steady_clock::now();  // throughput without the tokenizer's training
  Progress progress("tokenizing", r.bytes);
  int64_t done = 0;
  const int threads = std::max(1, int(std::thread::hardware_concurrency()));
  std::vector<DocumentPiece> chunk;
  size_t chunk_size = 0;
  // `at`: input bytes read; the progress line says 100% only once, at the end.
  auto encode = [&](int64_t at) {
    const auto ids = encode_documents(*tokenizer, chunk, threads);
    const auto held_out = size_t(double(ids.size()) * o.val_fraction);
    train.append(ids, 0, ids.size() - held_out);
    val.append(ids, ids.size() - held_out, held_out);
    chunk.clear(), chunk_size = 0;
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - tokenizing).count();
    progress.update(at == r.bytes ? at : std::min(at, r.bytes - 1),
                    fmt::format("{:.1f} MB/s of text, {} tokens/s", double(r.text_bytes) / 1e6 / std::max(s, 1e-9),
                                format_count(double(train.tokens() + val.tokens()) / std::max(s, 1e-9))));
  };
  for (const auto& path : files) {
    // Documents whole into a chunk of about chunk_bytes, the same chunks
    // whichever form (text, JSONL, compressed) the documents came in.
    DocumentReader reader(path, size_t(o.chunk_bytes), o.text_field, eot ? eot->text : "");
    DocumentPiece piece;
    while (reader.next(piece)) {
      r.documents += piece.ends_document;
      r.text_bytes += int64_t(piece.text.size());
      chunk_size += piece.text.size();
      chunk.push_back(std::move(piece));
      if (chunk_size >= size_t(o.chunk_bytes)) encode(done + reader.consumed());
    }
    done += int64_t(fs::file_size(path));
  }
  encode(r.bytes);
  train.finish();
  val.finish(/*empty_shard=*/o.val_fraction > 0);  // none held out: training splits its own, if any
  r.train_tokens = train.tokens();
  r.val_tokens = val.tokens();
  r.train_shards = train.shards();
  r.val_shards = val.shards();
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  r.tokenize_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - tokenizing).count();
  return r;
}

std::string describe(const PrepareResult& r) {
  const double tokenize_seconds = std::max(r.tokenize_seconds, 1e-9);
  return fmt::format("{} file(s) of {:.1f} MB, {} documents of {:.1f} MB of text -> {} train tokens in {} shard(s), "
                     "{} val tokens in {} (vocabulary {}) in {}; tokenized at {:.2f} MB/s of files, {:.2f} MB/s of "
                     "text",
                     r.files, double(r.bytes) / 1e6, r.documents, double(r.text_bytes) / 1e6,
                     format_count(double(r.train_tokens)), r.train_shards, format_count(double(r.val_tokens)),
                     r.val_shards, r.vocab_size, format_duration(r.seconds), double(r.bytes) / 1e6 / tokenize_seconds,
                     double(r.text_bytes) / 1e6 / tokenize_seconds);
}

}  // namespace noloco
