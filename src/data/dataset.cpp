#include "data/dataset.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "data/text_source.h"
#include "data/token_file.h"
#include "util/crc32c.h"
#include "util/files.h"
#include "util/splitmix.h"
#include "util/run_files.h"

namespace noloco {

namespace fs = std::filesystem;

namespace {

// Text is encoded this much at a time, cut at a line end: a file up to this
// size is encoded in one piece, as the whole text was before corpora streamed.
constexpr size_t kTextChunkBytes = 4 << 20;
constexpr int64_t kShardTokens = 100000000;

// The tokenizer of the model the run starts from (init_from), if it holds one.
std::unique_ptr<Tokenizer> model_tokenizer(const DataConfig& c) {
  if (c.model_dir.empty() || !holds_tokenizer(c.model_dir)) return nullptr;
  return load_tokenizer(c.model_dir);
}

// The bytes that occur in a text file (its char vocabulary), a chunk at a time.
std::string bytes_in(const std::string& path) {
  std::array<bool, 256> seen{};
  TextChunks chunks(path, kTextChunkBytes);
  std::string chunk, bytes;
  while (chunks.next(chunk))
    for (const char b : chunk) seen[uint8_t(b)] = true;
  for (int b = 0; b < 256; ++b)
    if (seen[size_t(b)]) bytes.push_back(char(b));
  return bytes;
}

std::unique_ptr<Tokenizer> text_tokenizer(const DataConfig& c) {
  if (auto t = model_tokenizer(c)) return t;
  if (!c.model_dir.empty())
    throw std::invalid_argument(fmt::format(
        "init_from {} has no tokenizer (tokenizer.model or a byte-level BPE tokenizer.json): name one with "
        "tokenizer=, or train on tokens prepared with it (data=FILE.bin)",
        c.model_dir));
  if (c.tokenizer == "char") return make_char_tokenizer(bytes_in(c.path));
  if (c.tokenizer == "bpe") return train_bpe_tokenizer({c.path}, c.vocab_size);
  return open_tokenizer(c.tokenizer);
}

// Token files in a directory where `prepare` left its tokenizer, the key not naming one.
bool takes_prepared_tokenizer(const DataConfig& c) {
  const bool unnamed = c.tokenizer == "char" || c.tokenizer == "bpe";
  return unnamed && names_token_files(c.path) && fs::is_directory(c.path) && holds_tokenizer(c.path);
}

std::unique_ptr<Tokenizer> token_data_tokenizer(const DataConfig& c, int64_t declared_vocab) {
  if (auto t = model_tokenizer(c)) return t;
  if (takes_prepared_tokenizer(c)) return load_tokenizer(c.path);
  const bool unnamed = c.tokenizer == "char" || c.tokenizer == "bpe";
  if (unnamed) return make_id_tokenizer(c.vocab_size > 0 ? c.vocab_size : declared_vocab);
  return open_tokenizer(c.tokenizer);
}

// Held while a worker tokenizes the run's text, so that the run does it once.
class DirectoryLock {
 public:
  explicit DirectoryLock(const std::string& dir) {
    fs::create_directories(dir);
    const auto path = dir + "/.lock";
    fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd_ < 0 || ::flock(fd_, LOCK_EX) != 0)
      throw std::runtime_error(fmt::format("cannot lock {}: {}", path, std::strerror(errno)));
  }
  ~DirectoryLock() { ::close(fd_); }
  DirectoryLock(const DirectoryLock&) = delete;
  DirectoryLock& operator=(const DirectoryLock&) = delete;

 private:
  int fd_ = -1;
};

// What the cached ids were encoded from: a changed file or tokenizer is encoded anew.
nlohmann::json text_source(const std::string& path, const Tokenizer& tokenizer) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0)
    throw std::runtime_error(fmt::format("cannot read {}: {}", path, std::strerror(errno)));
  return {{"source", fs::absolute(path).string()},
          {"bytes", int64_t(st.st_size)},
          {"modified_ns", int64_t(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec},
          {"tokenizer", tokenizer.kind()},
          {"vocab_size", tokenizer.vocab_size()}};
}

template <typename Sink>
void encode_text(const std::string& path, const Tokenizer& tokenizer, Sink&& sink) {
  TextChunks chunks(path, kTextChunkBytes);
  std::string chunk;
  while (chunks.next(chunk)) sink(tokenizer.encode(chunk));
}

// The ids of a text corpus, encoded once per run into `run_dir/tokens/` (the
// first worker encodes under a lock; the others, and resumes, map its shards).
TokenStream text_tokens(const DataConfig& c, const Tokenizer& tokenizer, const std::string& run_dir) {
  if (run_dir.empty()) {
    std::vector<int32_t> ids;
    encode_text(c.path, tokenizer, [&](const std::vector<int32_t>& part) { ids.insert(ids.end(), part.begin(), part.end()); });
    return TokenStream::hold(std::move(ids), c.path);
  }
  const std::string dir = run_files::in(run_dir, run_files::kTokens);
  const auto source = text_source(c.path, tokenizer);
  if (!file_exists(dir + "/source.json") || read_json(dir + "/source.json") != source) {
    std::remove((dir + "/source.json").c_str());
    ShardWriter shards(dir, "text", kShardTokens, tokenizer.vocab_size() > 65536, tokenizer.vocab_size());
    encode_text(c.path, tokenizer, [&](const std::vector<int32_t>& part) { shards.append(part, 0, part.size()); });
    shards.finish();
    write_json_atomic(dir + "/source.json", source);
  }
  return TokenStream::map_files(token_files(dir + "/text_*.bin"));
}

// A text corpus and its tokenizer; with a run directory, both made once per run.
TokenStream text_corpus(const DataConfig& c, const std::string& run_dir, std::unique_ptr<Tokenizer>& tokenizer) {
  if (fs::file_size(c.path) == 0) throw std::invalid_argument(fmt::format("data file '{}' is empty", c.path));
  if (run_dir.empty()) {
    tokenizer = text_tokenizer(c);
    return text_tokens(c, *tokenizer, run_dir);
  }
  const DirectoryLock lock(run_files::in(run_dir, run_files::kTokens));
  if (file_exists(run_files::in(run_dir, run_files::kTokenizer))) {
    tokenizer = load_tokenizer(run_dir);
  } else {
    tokenizer = text_tokenizer(c);
    tokenizer->save(run_dir);
  }
  return text_tokens(c, *tokenizer, run_dir);
}

// Token files' ids checked against the vocabulary: up front where their
// headers declare one, else as windows read them (reading a training corpus
// of billions of tokens at every start would make start-up grow with it).
TokenStream checked(TokenStream tokens, const std::string& spec, int64_t vocab) {
  if (tokens.declared_vocab() > vocab)
    throw std::invalid_argument(fmt::format("'{}' was prepared for a vocabulary of {}, more than the tokenizer's {}",
                                            spec, tokens.declared_vocab(), vocab));
  tokens.limit_ids(vocab);
  return tokens;
}

// What tells a file's checksum still holds: its modification time, and its
// inode and status-change time, which no user can set back (`touch -r`
// restores the first; a file written or swapped in has a new ctime).
nlohmann::json file_state(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0)
    throw std::runtime_error(fmt::format("cannot read {}: {}", path, std::strerror(errno)));
  const auto ns = [](const timespec& t) { return int64_t(t.tv_sec) * 1000000000 + t.tv_nsec; };
  return {{"modified_ns", ns(st.st_mtim)}, {"changed_ns", ns(st.st_ctim)}, {"inode", uint64_t(st.st_ino)}};
}
const std::vector<const char*> kFileStateKeys = {"modified_ns", "changed_ns", "inode"};

uint32_t file_crc32c(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::vector<char> piece(size_t(1) << 20);
  uint32_t crc = 0;
  while (in) {
    in.read(piece.data(), std::streamsize(piece.size()));
    crc = crc32c_extend(crc, piece.data(), size_t(in.gcount()));
  }
  if (in.bad()) throw std::runtime_error(fmt::format("cannot read {}: {}", path, std::strerror(errno)));
  return crc;
}

// The entry of `name` in a list of files, or null.
nlohmann::json entry_of(const nlohmann::json& files, const nlohmann::json& name) {
  for (const auto& f : files)
    if (f.value("file", "") == name) return f;
  return nlohmann::json();
}

// Each file's name, size, ids and content checksum. A file whose size and
// state (file_state) are what `was` recorded keeps its recorded checksum, so
// a resume reads no shard it already knows; the run's first start reads each
// once, and so does a resume each shard changed in any way since.
nlohmann::json file_identities(const TokenStream& tokens, const nlohmann::json& was) {
  auto out = nlohmann::json::array();
  for (const auto& f : tokens.file_identities()) {
    nlohmann::json entry = {{"file", f.name}, {"bytes", f.bytes}, {"ids", f.ids}};
    entry.update(file_state(f.path));
    const auto before = entry_of(was, f.name);
    bool known = before.is_object() && before.contains("crc32c") && before["bytes"] == entry["bytes"];
    for (const char* key : kFileStateKeys) known = known && before.contains(key) && before[key] == entry[key];
    entry["crc32c"] = known ? before["crc32c"].get<uint32_t>() : file_crc32c(f.path);
    out.push_back(entry);
  }
  return out;
}

// What a run trains on, as a resume checks it.
nlohmann::json corpus_identity(const DataConfig& c, const Corpus& corpus, const nlohmann::json& was) {
  if (!names_token_files(c.path)) return {{"text", text_source(c.path, *corpus.tokenizer)}};
  const auto recorded = [&](const char* split) {
    return was.is_object() ? was.value(split, nlohmann::json::array()) : nlohmann::json::array();
  };
  return {{"train", file_identities(corpus.train, recorded("train"))},
          {"val", file_identities(corpus.val, recorded("val"))}};
}

// An identity as compared: without the files' states (a copied corpus is
// the same corpus), and without checksums where `was` recorded none (a run
// started before they were kept).
nlohmann::json comparable(nlohmann::json identity, const nlohmann::json& was) {
  for (const char* split : {"train", "val"}) {
    if (!identity.contains(split)) continue;
    const auto before = was.is_object() ? was.value(split, nlohmann::json::array()) : nlohmann::json::array();
    const bool checksummed = before.empty() || before[0].contains("crc32c");
    for (auto& f : identity[split]) {
      for (const char* key : kFileStateKeys) f.erase(key);
      if (!checksummed) f.erase("crc32c");
    }
  }
  return identity;
}

// The first difference between two identities' lists of files, in words.
std::string changed_files(const std::string& split, const nlohmann::json& was, const nlohmann::json& now) {
  const auto find = entry_of;
  const auto described = [](const nlohmann::json& f) {
    return fmt::format("{} bytes, {} ids", f["bytes"].get<int64_t>(), f["ids"].get<int64_t>());
  };
  for (const auto& f : was) {
    const auto same = find(now, f["file"]);
    if (same.is_null())
      return fmt::format("{} shard {} ({}) is gone", split, f["file"].get<std::string>(), described(f));
    if (same["bytes"] != f["bytes"] || same["ids"] != f["ids"])
      return fmt::format("{} shard {} was {}, is now {}", split, f["file"].get<std::string>(), described(f),
                         described(same));
    if (same != f)
      return fmt::format("{} shard {} holds other tokens at the same size (CRC-32C {:08x}, now {:08x})", split,
                         f["file"].get<std::string>(), f.value("crc32c", uint32_t(0)), same.value("crc32c", uint32_t(0)));
  }
  for (const auto& f : now)
    if (find(was, f["file"]).is_null())
      return fmt::format("{} shard {} ({}) is new", split, f["file"].get<std::string>(), described(f));
  return "";
}

// Records what the run trains on; a resume over other data is refused.
void check_corpus_identity(const DataConfig& c, const Corpus& corpus, const std::string& run_dir, bool resuming) {
  const std::string path = run_files::in(run_dir, run_files::kCorpus);
  const auto was = file_exists(path) ? read_json(path) : nlohmann::json();
  const auto now = corpus_identity(c, corpus, was);
  if (was == now) return;
  const auto before = comparable(was, was), after = comparable(now, was);
  if (resuming && !c.accept_changed_data && !was.is_null() && before != after) {
    std::string change;
    if (was.contains("text") || now.contains("text")) {
      change = fmt::format("the text {} changed (size or time) or the data is no longer the same kind", c.path);
    } else {
      change = changed_files("training", before.value("train", nlohmann::json::array()), after["train"]);
      if (change.empty()) change = changed_files("validation", before.value("val", nlohmann::json::array()), after["val"]);
    }
    throw std::invalid_argument(fmt::format("resume: the data changed since the run started ({}; {} holds what it "
                                            "was): resumed, it is not the run it continues; accept_changed_data=true "
                                            "goes on over it",
                                            change, path));
  }
  fs::create_directories(run_dir);
  write_json_atomic(path, now);
}

}  // namespace

Corpus load_corpus(const DataConfig& c, int64_t context, const std::string& run_dir, bool resuming) {
  Corpus corpus;
  corpus.tokenizer_source = takes_prepared_tokenizer(c) ? c.path : c.tokenizer;
  TokenStream all;
  if (names_token_files(c.path)) {
    all = TokenStream::map_files(token_files(c.path), c.raw_tokens);
    if (!run_dir.empty() && file_exists(run_files::in(run_dir, run_files::kTokenizer))) {
      corpus.tokenizer = load_tokenizer(run_dir);
    } else {
      corpus.tokenizer = token_data_tokenizer(c, all.declared_vocab());
      if (!run_dir.empty()) {
        fs::create_directories(run_dir);
        corpus.tokenizer->save(run_dir);
      }
    }
  } else {
    if (!fs::exists(c.path)) throw std::invalid_argument(fmt::format("cannot open '{}': no such file", c.path));
    all = text_corpus(c, run_dir, corpus.tokenizer);
  }
  const int64_t vocab = corpus.tokenizer->vocab_size();
  all = checked(std::move(all), c.path, vocab);
  const auto val_files = c.val_path.empty() ? validation_files_beside(c.path) : token_files(c.val_path);
  if (!val_files.empty()) {
    corpus.train = all;
    corpus.val =
        checked(TokenStream::map_files(val_files, c.raw_tokens), c.val_path.empty() ? c.path : c.val_path, vocab);
  } else {
    corpus.validates = c.val_fraction > 0;
    const int64_t n_val = int64_t(double(all.size()) * c.val_fraction);
    corpus.train = all.slice(0, all.size() - n_val);
    corpus.val = all.slice(all.size() - n_val, all.size());
  }
  corpus.val.check_ids();
  const int64_t need = context + 1;
  if (corpus.train.size() < need || (corpus.validates && corpus.val.size() < need))
    throw std::invalid_argument(fmt::format(
        "corpus '{}' is too short: {} training and {} validation tokens, but one block needs {}", c.path,
        corpus.train.size(), corpus.val.size(), need));
  if (!run_dir.empty()) check_corpus_identity(c, corpus, run_dir, resuming);
  return corpus;
}

ModelConfig with_vocabulary(ModelConfig model, const Tokenizer& tokenizer) {
  if (model.vocab_size == 0) {
    model.vocab_size = tokenizer.vocab_size();
  } else if (tokenizer.vocab_size() > model.vocab_size) {
    throw std::invalid_argument(fmt::format("the tokenizer's {} tokens do not fit the model's vocabulary of {}",
                                            tokenizer.vocab_size(), model.vocab_size));
  }
  return model;
}

WindowSampler::WindowSampler(TokenStream tokens, int64_t context, uint64_t seed)
    : tokens_(std::move(tokens)), context_(context), seed_(seed) {}

Batch WindowSampler::sample(uint64_t index, int64_t first, int64_t count) const {
  const uint64_t starts = uint64_t(tokens_.size() - context_);  // valid window starts
  auto inputs = torch::empty({count, context_}, torch::kInt64);
  auto targets = torch::empty({count, context_}, torch::kInt64);
  auto* x = inputs.data_ptr<int64_t>();
  auto* y = targets.data_ptr<int64_t>();
  std::vector<int64_t> window(size_t(context_ + 1));
  for (int64_t r = 0; r < count; ++r) {
    const uint64_t key = splitmix64(splitmix64(seed_ ^ splitmix64(index)) + uint64_t(first + r));
    tokens_.read(int64_t(key % starts), context_ + 1, window.data());
    std::copy(window.begin(), window.end() - 1, x + r * context_);
    std::copy(window.begin() + 1, window.end(), y + r * context_);
  }
  return {inputs, targets};
}

}  // namespace noloco
