// `noloco prepare`: text, JSONL, gzip or zstd files or directories -> llm.c
// token shards (train_000000.bin, ..., val_000000.bin, ...: the directory
// `data=` reads) and the tokenizer beside them. Streams: the text is read,
// encoded and written a chunk at a time, so a corpus larger than memory works.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace noloco {

struct PrepareOptions {
  std::vector<std::string> inputs;  // files, or directories searched for files
  std::string out;                  // written: train_*.bin, val_*.bin, the tokenizer
  std::string tokenizer = "bpe";    // bpe (trained on the inputs) | a .model | a directory holding a tokenizer
  int64_t vocab_size = 8192;        // for bpe
  double val_fraction = 0.01;       // the tail of every chunk
  int64_t chunk_bytes = 4 << 20;    // text encoded at a time (documents whole, long ones cut at a line end)
  std::string text_field = "text";  // the document of a .jsonl line
  int64_t shard_tokens = 100000000; // llm.c's fineweb shards: 10^8 tokens
};

struct PrepareResult {
  int64_t files = 0, bytes = 0, documents = 0, train_tokens = 0, val_tokens = 0, vocab_size = 0;
  int64_t text_bytes = 0;  // the documents' text (`bytes` counts the files: compressed, or JSONL with its syntax)
  int64_t train_shards = 0, val_shards = 0;
  double seconds = 0, tokenize_seconds = 0;  // all of it; encoding and writing alone
};

// Throws std::invalid_argument / std::runtime_error with a one-line reason
// (naming the file and line of a malformed JSONL document); leaves no partial
// token file behind.
PrepareResult prepare_corpus(const PrepareOptions& options);

// One line: what was read, what was written, how fast.
std::string describe(const PrepareResult& r);

}  // namespace noloco
