// Text <-> token ids: characters, sentencepiece BPE, byte-level BPE from a
// Hugging Face tokenizer.json, or bare ids. Each tokenizer saves itself into a directory (run or
// checkpoint) so generation and resume use exactly the vocabulary trained on.
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace noloco {

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  virtual std::string kind() const = 0;
  virtual int64_t vocab_size() const = 0;
  // Throws std::invalid_argument on text the vocabulary cannot represent.
  virtual std::vector<int32_t> encode(const std::string& text) const = 0;
  virtual std::string decode(const std::vector<int32_t>& ids) const = 0;
  virtual void save(const std::string& dir) const = 0;
  // The tokenizer files of a Hugging Face model directory: tokenizer.model and
  // tokenizer_config.json for sentencepiece; for the char and id vocabularies,
  // which transformers has no class for, noloco_tokenizer.json (what save()
  // writes, read back by load_tokenizer), and for char also a byte-level
  // tokenizer.json that PreTrainedTokenizerFast loads.
  virtual void save_hf(const std::string& dir) const = 0;
  // The token that ends a document, where the vocabulary has one: its id, and
  // the text that stands for it between the documents of a plain-text corpus
  // (TinyStories writes <|endoftext|>).
  struct EndOfText {
    int32_t id;
    std::string text;
  };
  virtual std::optional<EndOfText> end_of_text() const { return std::nullopt; }
};

// Byte-level vocabulary of the bytes that occur in `text`, sorted (as nanoGPT's char model).
std::unique_ptr<Tokenizer> make_char_tokenizer(const std::string& text);
// Trains a sentencepiece BPE model on the files (on a sample of a million
// lines where they hold more); the model is kept in memory.
std::unique_ptr<Tokenizer> train_bpe_tokenizer(const std::vector<std::string>& text_paths, int64_t vocab_size);
std::unique_ptr<Tokenizer> load_sentencepiece(const std::string& model_path);
// `path` as the tokenizer= key names one: a sentencepiece .model file, or a
// directory holding a tokenizer (see load_tokenizer).
std::unique_ptr<Tokenizer> open_tokenizer(const std::string& path);
// For pre-tokenized data without a tokenizer: ids are printed as numbers.
std::unique_ptr<Tokenizer> make_id_tokenizer(int64_t vocab_size);
// The tokenizer of a run, checkpoint or Hugging Face directory: what
// Tokenizer::save or save_hf wrote, or a tokenizer.model.
std::unique_ptr<Tokenizer> load_tokenizer(const std::string& dir);
// Whether `dir` holds a tokenizer load_tokenizer reads.
bool holds_tokenizer(const std::string& dir);
// A byte-level BPE tokenizer from the tokenizers library's `file` in `dir`
// (with the tokenizer_config.json beside it, if any).
std::unique_ptr<Tokenizer> load_byte_level_bpe(const std::string& dir, const std::string& file);
// The names of every file a saved tokenizer may consist of (to copy one, or clear one away).
const std::vector<std::string>& tokenizer_files();

}  // namespace noloco
