// Text read a piece at a time, for corpora larger than memory: plain, gzip
// (.gz) or zstd (.zst) files, as line-cut chunks or as documents (a JSONL
// line's text field, or the text between end-of-text markers).
#pragma once
#include <cstdint>
#include <memory>
#include <string>

namespace noloco {

// The bytes of a file, decompressed by its extension (.gz, .zst), in order.
class ByteSource {
 public:
  virtual ~ByteSource() = default;
  // Up to `size` bytes into `out`; 0 at the end. Throws std::runtime_error naming the file.
  virtual size_t read(char* out, size_t size) = 0;
  // Bytes of the file itself consumed so far (compressed bytes for .gz and .zst).
  virtual int64_t consumed() const = 0;
};
std::unique_ptr<ByteSource> open_byte_source(const std::string& path);

// Where to cut `text` so the first part is at most `limit` bytes: after its
// last line end, else before the character that straddles the limit.
size_t cut_point(const std::string& text, size_t limit);

// A file's text in chunks of at most `limit` bytes cut at line ends, so no
// line is split where it need not be.
class TextChunks {
 public:
  TextChunks(const std::string& path, size_t limit);
  bool next(std::string& chunk);

 private:
  std::unique_ptr<ByteSource> source_;
  size_t limit_;
  std::string pending_;
  bool ended_ = false;
};

// A piece of one document: documents longer than the reader's limit come in
// several, cut at line ends from the document's start.
struct DocumentPiece {
  std::string text;
  bool ends_document = false;
};

// The documents of one file. `.jsonl` (before any .gz/.zst): one JSON object a
// line, its `text_field` a document; a line that is not such an object, or
// whose text is not valid UTF-8, is refused naming the file and line. Other
// files: the text between occurrences of `separator` (the tokenizer's
// end-of-text marker, e.g. TinyStories' <|endoftext|>; none if empty) is a
// document, and so is what a file ends with. Empty documents are skipped, so
// the same documents give the same pieces whichever way they came.
class DocumentReader {
 public:
  DocumentReader(const std::string& path, size_t limit, std::string text_field, std::string separator);
  ~DocumentReader();
  bool next(DocumentPiece& piece);
  // Bytes of the file consumed so far (compressed bytes for .gz and .zst).
  int64_t consumed() const { return source_->consumed(); }

 private:
  bool next_jsonl(DocumentPiece& piece);
  bool next_text(DocumentPiece& piece);
  bool fill();
  std::string path_;
  std::unique_ptr<ByteSource> source_;
  size_t limit_;
  std::string field_, separator_;
  bool jsonl_;
  std::string buffer_;      // read, not yet handed out
  size_t at_ = 0;           // first byte of buffer_ not handed out
  bool ended_ = false;
  int64_t line_ = 0;
  std::string document_;    // a JSONL document still being handed out in pieces
  size_t document_at_ = 0;
};

}  // namespace noloco
