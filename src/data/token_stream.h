// A corpus of token ids read where it lies: llm.c shards memory-mapped
// read-only and seen as one concatenated stream, each id read in its own
// width when a window asks for it. A worker's memory does not grow with the
// corpus (only the pages its windows touch are ever read), and every worker
// of a machine shares the page cache of one copy.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace noloco {

class TokenStream {
 public:
  TokenStream() = default;
  // The files in order, memory-mapped; one line naming the file on a malformed
  // one, an unknown magic, or shards that declare different vocabularies or id
  // widths. `raw`: the files are nanoGPT's bare uint16 arrays, no header.
  static TokenStream map_files(const std::vector<std::string>& paths, bool raw = false);
  // Ids held in memory (tests, and text encoded where no run directory caches it).
  static TokenStream hold(std::vector<int32_t> ids, std::string name);

  int64_t size() const { return end_ - begin_; }
  // Ids [begin, end) of this stream, sharing its files.
  TokenStream slice(int64_t begin, int64_t end) const;
  // The vocabulary the files declared (0: none said).
  int64_t declared_vocab() const;
  // Ids at or past `vocab` are refused when read, naming the file and position:
  // checking them up front would read the whole corpus at every start.
  void limit_ids(int64_t vocab) { vocab_limit_ = vocab; }
  // Reads every id now (a validation set: small, and better refused before any
  // worker starts); throws std::invalid_argument naming the file of one past the limit.
  void check_ids() const;
  // Copies ids [at, at + count) widened to int64.
  void read(int64_t at, int64_t count, int64_t* out) const;

  // A mapped file as a resume checks it is unchanged: name, size, ids.
  struct FileIdentity {
    std::string name, path;  // its file name, and where it is
    int64_t bytes = 0, ids = 0;
  };
  // The files this stream maps, in order (none for ids held in memory).
  std::vector<FileIdentity> file_identities() const;

  struct Files;  // the mapped files, shared by slices (defined in the .cpp)

 private:
  std::shared_ptr<const Files> files_;
  int64_t begin_ = 0, end_ = 0;
  int64_t vocab_limit_ = 0;
};

// The token files `spec` names: a file; a glob (llm.c's `fineweb_train_*.bin`);
// or a directory, meaning its `*train*.bin` shards if it has any (what
// `prepare` and llm.c write), else every `*.bin` in it. Sorted by name.
// Throws std::invalid_argument naming `spec` when nothing matches.
std::vector<std::string> token_files(const std::string& spec);
// The validation shards beside a directory `spec` (its `*val*.bin`); empty if
// `spec` is no directory or holds none.
std::vector<std::string> validation_files_beside(const std::string& spec);
// Whether `spec` names token data (a .bin file, a directory or a glob) rather than text.
bool names_token_files(const std::string& spec);

}  // namespace noloco
