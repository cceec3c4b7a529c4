// Text <-> token ids. Each tokenizer saves itself into a directory (run or
// checkpoint) so generation and resume use exactly the vocabulary trained on.
#pragma once
#include <cstdint>
#include <memory>
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
};

// Byte-level vocabulary of the bytes that occur in `text`, sorted (as nanoGPT's char model).
std::unique_ptr<Tokenizer> make_char_tokenizer(const std::string& text);
// Trains a sentencepiece BPE model on the file; the model is kept in memory.
std::unique_ptr<Tokenizer> train_bpe_tokenizer(const std::string& text_path, int64_t vocab_size);
std::unique_ptr<Tokenizer> load_sentencepiece(const std::string& model_path);
// For pre-tokenized data without a tokenizer: ids are printed as numbers.
std::unique_ptr<Tokenizer> make_id_tokenizer(int64_t vocab_size);
// Loads what Tokenizer::save wrote into `dir`.
std::unique_ptr<Tokenizer> load_tokenizer(const std::string& dir);

}  // namespace noloco
