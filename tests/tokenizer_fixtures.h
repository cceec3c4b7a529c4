// Small tokenizer.json files in the tokenizers library's real format, in the
// layouts of GPT-2, Llama 3 and SmolLM2: every byte is a token whose id is
// the byte's value (GPT-2's byte-level characters, so byte 0x20 is "Ġ", id
// 32), then a few merged tokens from id 256 and the added tokens.
#pragma once
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "data/byte_level_bpe.h"

namespace noloco::testing {

using Json = nlohmann::json;

// Llama 3's pre-tokenizer pattern, as its tokenizer.json carries it.
inline const char* kLlama3Pattern =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

inline const Json kByteLevel = {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true}, {"use_regex", false}};

// Bytes as tokens (id = byte value), then `extra` tokens from id 256 on.
inline Json vocabulary(const std::vector<std::string>& extra) {
  Json vocab = Json::object();
  for (int b = 0; b < 256; ++b) vocab[byte_level_char(uint8_t(b))] = b;
  for (size_t i = 0; i < extra.size(); ++i) vocab[extra[i]] = 256 + i;
  return vocab;
}

inline Json tokenizer_json(Json pre_tokenizer, Json vocab, Json merges, Json added, bool ignore_merges = false) {
  return {{"version", "1.0"},
          {"truncation", nullptr},
          {"padding", nullptr},
          {"added_tokens", added},
          {"normalizer", nullptr},
          {"pre_tokenizer", pre_tokenizer},
          {"post_processor", nullptr},
          {"decoder", kByteLevel},
          {"model",
           {{"type", "BPE"},
            {"dropout", nullptr},
            {"unk_token", nullptr},
            {"continuing_subword_prefix", nullptr},
            {"end_of_word_suffix", nullptr},
            {"fuse_unk", false},
            {"byte_fallback", false},
            {"ignore_merges", ignore_merges},
            {"vocab", vocab},
            {"merges", merges}}}};
}

// GPT-2's layout: the ByteLevel pre-tokenizer splits with GPT-2's pattern.
// Merges, by rank: Ġ t, h e, Ġt he, Ġ w (merges as "a b" strings, GPT-2's format).
inline Json gpt2_style() {
  return tokenizer_json({{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true}, {"use_regex", true}},
                        vocabulary({"Ġt", "he", "Ġthe", "Ġw"}), {"Ġ t", "h e", "Ġt he", "Ġ w"},
                        Json::array({{{"id", 260}, {"content", "<|endoftext|>"}, {"special", true}}}));
}

// Llama 3's layout: a Split with its pattern, then ByteLevel without one;
// ignore_merges (a piece that is a token is taken whole); merges as pairs.
inline Json llama3_style() {
  const Json split = {{"type", "Split"},
                      {"pattern", {{"Regex", kLlama3Pattern}}},
                      {"behavior", "Isolated"},
                      {"invert", false}};
  return tokenizer_json({{"type", "Sequence"}, {"pretokenizers", {split, kByteLevel}}},
                        vocabulary({"Ġthe", "12", "123"}), Json::array({Json::array({"1", "2"})}),
                        Json::array({{{"id", 259}, {"content", "<|begin_of_text|>"}, {"special", true}},
                                     {{"id", 260}, {"content", "<|end_of_text|>"}, {"special", true}}}),
                        /*ignore_merges=*/true);
}

// SmolLM2's layout: every digit on its own, then ByteLevel with GPT-2's pattern.
inline Json smollm2_style() {
  return tokenizer_json(
      {{"type", "Sequence"},
       {"pretokenizers",
        {{{"type", "Digits"}, {"individual_digits", true}},
         {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true}, {"use_regex", true}}}}},
      vocabulary({}), Json::array(), Json::array({{{"id", 256}, {"content", "<|im_start|>"}, {"special", true}}}));
}

}  // namespace noloco::testing
