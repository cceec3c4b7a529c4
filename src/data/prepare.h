// `noloco prepare`: text files or directories -> train.bin and val.bin (the
// token files `data=` and `val_data=` read) and the tokenizer beside them.
// Streams: the text is read, encoded and written a chunk at a time, so a
// corpus larger than memory works.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace noloco {

struct PrepareOptions {
  std::vector<std::string> inputs;  // text files, or directories searched for files
  std::string out;                  // written: train.bin, val.bin, the tokenizer
  std::string tokenizer = "bpe";    // bpe (trained on the inputs) | a .model | a directory holding a tokenizer
  int64_t vocab_size = 8192;        // for bpe
  double val_fraction = 0.01;       // the tail of every chunk
  int64_t chunk_bytes = 4 << 20;    // text encoded at a time (cut at a line end)
};

struct PrepareResult {
  int64_t files = 0, bytes = 0, train_tokens = 0, val_tokens = 0, vocab_size = 0;
  double seconds = 0, tokenize_seconds = 0;  // all of it; encoding and writing alone
};

// Throws std::invalid_argument / std::runtime_error with a one-line reason;
// leaves no partial token file behind.
PrepareResult prepare_corpus(const PrepareOptions& options);

}  // namespace noloco
