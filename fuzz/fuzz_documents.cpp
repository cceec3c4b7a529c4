// libFuzzer target: corpus text read as documents (data/text_source.h). The
// first byte picks the form: JSONL, JSONL compressed with zstd or gzip, or
// plain text split at an end-of-text marker; the rest is the file.
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <stdexcept>
#include <string>

#include "data/text_source.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  static const char* kNames[] = {"docs.jsonl", "docs.jsonl.zst", "docs.jsonl.gz", "docs.txt"};
  const std::string path = "/tmp/noloco_fuzz_" + std::to_string(::getpid()) + "_" + kNames[data[0] % 4];
  if (std::FILE* f = std::fopen(path.c_str(), "wb")) {
    std::fwrite(data + 1, 1, size - 1, f);
    std::fclose(f);
  }
  try {
    noloco::DocumentReader reader(path, 64, "text", "<|end|>");
    noloco::DocumentPiece piece;
    while (reader.next(piece))
      if (piece.text.size() > 64) __builtin_trap();  // pieces never exceed the limit
  } catch (const std::runtime_error&) {
  }
  std::remove(path.c_str());
  return 0;
}
