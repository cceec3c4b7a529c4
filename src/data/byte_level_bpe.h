// Byte-level BPE tokenizers as Hugging Face's tokenizers library writes them
// (tokenizer.json): GPT-2, Llama 3, SmolLM2 and most current models. Text is
// cut at added tokens, split by the pre-tokenizer (regular expressions with
// Unicode classes, through PCRE2), each piece's bytes mapped to GPT-2's
// byte-level characters and merged by the ranked merges. What the file asks
// for and this does not implement (normalizers, other models or
// pre-tokenizers) is refused with one line naming it.
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "data/tokenizer.h"

namespace noloco {

// GPT-2's byte-to-character table, the one the ByteLevel pre-tokenizer uses:
// printable bytes stand for themselves, the others for U+0100 onwards. As UTF-8.
std::string byte_level_char(uint8_t b);

class PreTokenizer;

class ByteLevelBpe final : public Tokenizer {
 public:
  // `json` is a tokenizer.json's text, `config` its tokenizer_config.json's
  // (may be empty; kept for export). `where` names the file in errors.
  ByteLevelBpe(std::string json, std::string config, const std::string& where);
  ~ByteLevelBpe() override;

  std::string kind() const override { return "byte-level BPE"; }
  int64_t vocab_size() const override { return vocab_size_; }
  std::optional<EndOfText> end_of_text() const override { return eos_; }
  std::vector<int32_t> encode(const std::string& text) const override;
  std::string decode(const std::vector<int32_t>& ids) const override;
  // Both keep the files as they came, tokenizer.json (+ tokenizer_config.json),
  // in runs, checkpoints, `prepare`'s output and exports alike. (Runs of
  // earlier versions hold them as hf_tokenizer.json beside a tokenizer.json
  // of noloco's naming it; load_tokenizer reads both.)
  void save(const std::string& dir) const override;
  void save_hf(const std::string& dir) const override;

  // The pieces the pre-tokenizer cuts `text` into (no added tokens in it), before BPE.
  std::vector<std::string> pre_tokenize(const std::string& text) const;

 private:
  std::vector<int32_t> bpe(const std::string& piece) const;  // `piece` in byte-level characters
  std::optional<EndOfText> find_end_of_text() const;
  std::string json_, config_;
  std::unordered_map<std::string, int32_t> vocab_;
  std::vector<std::string> tokens_;                   // by id; empty where no token has that id
  std::unordered_map<std::string, int32_t> ranks_;    // "left\x01right" -> merge rank
  std::map<std::string, int32_t> added_;              // added tokens' contents -> id
  std::vector<bool> is_added_;                        // by id
  bool ignore_merges_ = false;
  int64_t vocab_size_ = 0;
  std::optional<EndOfText> eos_;
  std::unique_ptr<PreTokenizer> pre_;
};

// Whether `json` (a tokenizer.json's text, parsed) is the tokenizers library's format.
bool is_hf_tokenizer_json(const std::string& path);

}  // namespace noloco
