#include "data/byte_level_bpe.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <algorithm>
#include <array>
#include <climits>
#include <cctype>
#include <stdexcept>
#include <utility>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "util/files.h"

namespace noloco {

namespace {

using Json = nlohmann::json;

bool printable_byte(int b) { return (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || b >= 174; }

// The code point GPT-2's table gives byte `b`.
uint32_t byte_level_code_point(uint8_t b) {
  if (printable_byte(b)) return b;
  uint32_t cp = 256;
  for (int other = 0; other < b; ++other)
    if (!printable_byte(other)) ++cp;
  return cp;
}

void append_utf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out.push_back(char(cp));
  } else if (cp < 0x800) {
    out.push_back(char(0xc0 | (cp >> 6)));
    out.push_back(char(0x80 | (cp & 0x3f)));
  } else if (cp < 0x10000) {
    out.push_back(char(0xe0 | (cp >> 12)));
    out.push_back(char(0x80 | ((cp >> 6) & 0x3f)));
    out.push_back(char(0x80 | (cp & 0x3f)));
  } else {
    out.push_back(char(0xf0 | (cp >> 18)));
    out.push_back(char(0x80 | ((cp >> 12) & 0x3f)));
    out.push_back(char(0x80 | ((cp >> 6) & 0x3f)));
    out.push_back(char(0x80 | (cp & 0x3f)));
  }
}

// Bytes of the UTF-8 sequence that starts with `lead` (1 for a stray byte).
size_t utf8_length(uint8_t lead) {
  if (lead >= 0xf0 && lead < 0xf8) return 4;
  if (lead >= 0xe0) return lead < 0xf0 ? 3 : 1;
  if (lead >= 0xc0) return 2;
  return 1;
}

struct ByteLevelTables {
  std::array<std::string, 256> chars;               // byte -> its character, as UTF-8
  std::unordered_map<std::string, uint8_t> bytes;   // and back
  static const ByteLevelTables& get() {
    static const ByteLevelTables t = [] {
      ByteLevelTables t;
      for (int b = 0; b < 256; ++b) {
        append_utf8(t.chars[size_t(b)], byte_level_code_point(uint8_t(b)));
        t.bytes[t.chars[size_t(b)]] = uint8_t(b);
      }
      return t;
    }();
    return t;
  }
};

// GPT-2's split, which the ByteLevel pre-tokenizer applies with use_regex.
constexpr const char* kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

[[noreturn]] void refuse(const std::string& where, const std::string& what) {
  throw std::runtime_error(fmt::format("{}: {}", where, what));
}

// A compiled regular expression with Unicode classes; thread-safe to match.
class Regex {
 public:
  Regex(const std::string& pattern, const std::string& where) {
    int error = 0;
    PCRE2_SIZE offset = 0;
    // Invalid UTF-8 in the text never matches (it becomes a piece of its own)
    // instead of failing the whole match.
    code_ = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.c_str()), pattern.size(),
                          PCRE2_UTF | PCRE2_UCP | PCRE2_MATCH_INVALID_UTF, &error, &offset, nullptr);
    if (!code_) {
      std::array<PCRE2_UCHAR, 256> message{};
      pcre2_get_error_message(error, message.data(), message.size());
      refuse(where, fmt::format("pre-tokenizer pattern {} does not compile at {}: {}", Json(pattern).dump(), offset,
                                reinterpret_cast<const char*>(message.data())));
    }
    pcre2_jit_compile(code_, PCRE2_JIT_COMPLETE);  // where JIT is not available, matching is interpreted
  }
  ~Regex() { pcre2_code_free(code_); }
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;

  // [begin, end) of every match in `text`, in order.
  std::vector<std::pair<size_t, size_t>> matches(const std::string& text) const {
    std::vector<std::pair<size_t, size_t>> out;
    pcre2_match_data* data = pcre2_match_data_create_from_pattern(code_, nullptr);
    const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
    for (size_t at = 0; at < text.size();) {
      const int rc = pcre2_match(code_, subject, text.size(), at, 0, data, nullptr);
      if (rc < 0) break;  // no further match (or a limit hit: the rest stays one piece)
      const PCRE2_SIZE* v = pcre2_get_ovector_pointer(data);
      if (v[1] == v[0]) {  // an empty match: step over one character
        at = v[0] + utf8_length(uint8_t(text[v[0]]));
        continue;
      }
      out.emplace_back(v[0], v[1]);
      at = v[1];
    }
    pcre2_match_data_free(data);
    return out;
  }

 private:
  pcre2_code* code_ = nullptr;
};

}  // namespace

std::string byte_level_char(uint8_t b) { return ByteLevelTables::get().chars[b]; }

// One step of the pre-tokenizer: each piece in, its pieces out.
class PreTokenizer {
 public:
  virtual ~PreTokenizer() = default;
  virtual void split(const std::string& piece, std::vector<std::string>& out) const = 0;
};

namespace {

enum class Behavior { isolated, removed, merged_with_previous, merged_with_next };

// Cuts a piece at the matches of a pattern, as the Split pre-tokenizer does.
class SplitStep : public PreTokenizer {
 public:
  SplitStep(const std::string& pattern, Behavior behavior, const std::string& where)
      : regex_(pattern, where), behavior_(behavior) {}
  void split(const std::string& piece, std::vector<std::string>& out) const override {
    const size_t first = out.size();
    size_t last = 0;
    std::string carry;  // a match waiting to be merged with the next piece
    auto emit = [&](std::string s) {
      if (!carry.empty()) s = std::exchange(carry, "") + s;
      if (!s.empty()) out.push_back(std::move(s));
    };
    for (const auto& [begin, end] : regex_.matches(piece)) {
      if (begin > last) emit(piece.substr(last, begin - last));
      const auto match = piece.substr(begin, end - begin);
      switch (behavior_) {
        case Behavior::isolated: emit(match); break;
        case Behavior::removed: break;
        case Behavior::merged_with_previous:
          if (out.size() > first) out.back() += match;
          else emit(match);
          break;
        case Behavior::merged_with_next: carry += match; break;
      }
      last = end;
    }
    if (last < piece.size()) emit(piece.substr(last));
    if (!carry.empty()) out.push_back(carry);
  }

 private:
  Regex regex_;
  Behavior behavior_;
};

// ByteLevel: GPT-2's split when use_regex, a space in front when add_prefix_space.
class ByteLevelStep : public PreTokenizer {
 public:
  ByteLevelStep(bool prefix_space, bool use_regex, const std::string& where) : prefix_space_(prefix_space) {
    if (use_regex) gpt2_ = std::make_unique<SplitStep>(kGpt2Pattern, Behavior::isolated, where);
  }
  void split(const std::string& piece, std::vector<std::string>& out) const override {
    const std::string spaced = prefix_space_ && piece.rfind(' ', 0) != 0 ? " " + piece : piece;
    if (gpt2_) gpt2_->split(spaced, out);
    else out.push_back(spaced);
  }

 private:
  bool prefix_space_;
  std::unique_ptr<SplitStep> gpt2_;
};

class SequenceStep : public PreTokenizer {
 public:
  explicit SequenceStep(std::vector<std::unique_ptr<PreTokenizer>> steps) : steps_(std::move(steps)) {}
  void split(const std::string& piece, std::vector<std::string>& out) const override {
    std::vector<std::string> pieces{piece};
    for (const auto& step : steps_) {
      std::vector<std::string> next;
      for (const auto& p : pieces) step->split(p, next);
      pieces = std::move(next);
    }
    out.insert(out.end(), pieces.begin(), pieces.end());
  }

 private:
  std::vector<std::unique_ptr<PreTokenizer>> steps_;
};

class WholeStep : public PreTokenizer {
 public:
  void split(const std::string& piece, std::vector<std::string>& out) const override { out.push_back(piece); }
};

bool flag(const Json& j, const char* key, bool fallback) {
  const auto it = j.find(key);
  return it == j.end() || it->is_null() ? fallback : it->get<bool>();
}

std::unique_ptr<PreTokenizer> make_pre_tokenizer(const Json& j, const std::string& where, bool& byte_level) {
  if (j.is_null()) return std::make_unique<WholeStep>();
  const std::string type = j.value("type", "");
  if (type == "Sequence") {
    std::vector<std::unique_ptr<PreTokenizer>> steps;
    for (const auto& step : j.at("pretokenizers")) steps.push_back(make_pre_tokenizer(step, where, byte_level));
    return std::make_unique<SequenceStep>(std::move(steps));
  }
  if (type == "ByteLevel") {
    byte_level = true;
    return std::make_unique<ByteLevelStep>(flag(j, "add_prefix_space", true), flag(j, "use_regex", true), where);
  }
  // Digits on their own, every one or every run: the tokenizers library's
  // is_numeric, Unicode's N categories (½ and ٣ too, not only 0-9).
  if (type == "Digits")
    return std::make_unique<SplitStep>(flag(j, "individual_digits", false) ? "\\p{N}" : "\\p{N}+", Behavior::isolated,
                                       where);
  if (type == "Split") {
    if (flag(j, "invert", false)) refuse(where, "pre-tokenizer Split with invert=true is not implemented");
    const auto& pattern = j.at("pattern");
    std::string regex;
    if (pattern.contains("Regex")) {
      regex = pattern["Regex"].get<std::string>();
    } else if (pattern.contains("String")) {
      // A literal: every character quoted.
      for (char c : pattern["String"].get<std::string>()) {
        if (std::isalnum(uint8_t(c)) || uint8_t(c) >= 0x80) regex.push_back(c);
        else regex += std::string("\\") + c;
      }
    } else {
      refuse(where, "pre-tokenizer Split needs a Regex or String pattern");
    }
    const std::string behavior = j.value("behavior", "Isolated");
    const std::map<std::string, Behavior> behaviors = {{"Isolated", Behavior::isolated},
                                                       {"Removed", Behavior::removed},
                                                       {"MergedWithPrevious", Behavior::merged_with_previous},
                                                       {"MergedWithNext", Behavior::merged_with_next}};
    const auto b = behaviors.find(behavior);
    if (b == behaviors.end()) refuse(where, fmt::format("pre-tokenizer Split behavior '{}' is not implemented", behavior));
    return std::make_unique<SplitStep>(regex, b->second, where);
  }
  refuse(where, fmt::format("pre-tokenizer '{}' is not implemented (ByteLevel, Split, Digits and Sequence are)", type));
}

}  // namespace

// The config's eos_token where it names an added token, else the end-of-text
// token GPT-2, SmolLM2 (<|endoftext|>) or Llama 3 (<|end_of_text|>) add.
std::optional<Tokenizer::EndOfText> ByteLevelBpe::find_end_of_text() const {
  std::vector<std::string> names;
  const auto config = Json::parse(config_, nullptr, false);
  if (config.is_object() && config.contains("eos_token")) {
    const auto& eos = config["eos_token"];
    if (eos.is_string()) names.push_back(eos.get<std::string>());
    if (eos.is_object() && eos.value("content", Json()).is_string()) names.push_back(eos["content"].get<std::string>());
  }
  names.insert(names.end(), {"<|endoftext|>", "<|end_of_text|>"});
  for (const auto& name : names)
    if (const auto it = added_.find(name); it != added_.end()) return EndOfText{it->second, name};
  return std::nullopt;
}

ByteLevelBpe::ByteLevelBpe(std::string json, std::string config, const std::string& where)
    : json_(std::move(json)), config_(std::move(config)) {
  const auto j = Json::parse(json_, nullptr, false);
  if (j.is_discarded() || !j.is_object()) refuse(where, "not JSON");
  try {
    if (!j.value("normalizer", Json()).is_null())
      refuse(where, fmt::format("normalizer '{}' is not implemented (byte-level BPE tokenizers have none)",
                                j["normalizer"].value("type", "?")));
    const auto& model = j.at("model");
    if (model.value("type", "") != "BPE")
      refuse(where, fmt::format("model type '{}' is not implemented (BPE is)", model.value("type", "")));
    // GPT-2's own file writes the affixes as empty strings: the same as none.
    for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix", "dropout"}) {
      const auto v = model.value(key, Json());
      if (!v.is_null() && v != "") refuse(where, fmt::format("BPE '{}' is not implemented", key));
    }
    if (flag(model, "byte_fallback", false)) refuse(where, "BPE byte_fallback is not implemented (byte-level BPE needs none)");
    ignore_merges_ = flag(model, "ignore_merges", false);
    bool byte_level = false;
    pre_ = make_pre_tokenizer(j.value("pre_tokenizer", Json()), where, byte_level);
    const auto& decoder = j.value("decoder", Json());
    if (!byte_level || decoder.is_null() || decoder.value("type", "") != "ByteLevel")
      refuse(where, "only byte-level BPE is implemented (a ByteLevel pre-tokenizer and decoder)");

    int64_t largest = -1;
    for (const auto& [token, id] : model.at("vocab").items()) {
      const int64_t i = id.get<int64_t>();
      if (i < 0 || i >= INT32_MAX) refuse(where, fmt::format("token {} has id {}", Json(token).dump(), i));
      vocab_[token] = int32_t(i);
      largest = std::max(largest, i);
    }
    for (const auto& added : j.value("added_tokens", Json::array())) {
      const int64_t i = added.at("id").get<int64_t>();
      if (i < 0 || i >= INT32_MAX) refuse(where, fmt::format("added token id {}", i));
      const auto content = added.at("content").get<std::string>();
      if (content.empty()) refuse(where, "an added token is empty");
      added_[content] = int32_t(i);
      largest = std::max(largest, i);
    }
    vocab_size_ = largest + 1;
    tokens_.resize(size_t(vocab_size_));
    is_added_.assign(size_t(vocab_size_), false);
    // One id, one token (an added token may also stand in the vocabulary, under its own id).
    auto name = [&](int32_t id, const std::string& token) {
      auto& slot = tokens_[size_t(id)];
      if (!slot.empty() && slot != token)
        refuse(where, fmt::format("id {} names both {} and {}", id, Json(slot).dump(), Json(token).dump()));
      slot = token;
    };
    for (const auto& [token, id] : vocab_) name(id, token);
    for (const auto& [content, id] : added_) {
      name(id, content);
      is_added_[size_t(id)] = true;
    }
    int32_t rank = 0;
    for (const auto& merge : model.value("merges", Json::array())) {
      std::string left, right;
      if (merge.is_string()) {  // "left right"
        const auto s = merge.get<std::string>();
        const auto space = s.find(' ');
        if (space == std::string::npos) refuse(where, fmt::format("merge {} is not two tokens", merge.dump()));
        left = s.substr(0, space);
        right = s.substr(space + 1);
      } else {
        left = merge.at(0).get<std::string>();
        right = merge.at(1).get<std::string>();
      }
      if (!vocab_.count(left + right))
        refuse(where, fmt::format("merge {} makes a token outside the vocabulary", merge.dump()));
      ranks_.emplace(left + '\x01' + right, rank++);
    }
    eos_ = find_end_of_text();
  } catch (const Json::exception& e) {
    refuse(where, fmt::format("malformed tokenizer.json: {}", e.what()));
  }
  // Real vocabularies may lack rare lead bytes (StarCoder's has no 0xc0,
  // 0xc1, 0xf1 or 0xf5-0xff; text holding one is refused when encoded), but
  // one that cannot encode ASCII is broken.
  for (int b = 0; b < 0x80; ++b)
    if (!vocab_.count(byte_level_char(uint8_t(b))))
      refuse(where, fmt::format("the vocabulary lacks byte 0x{:02x}: not every text could be encoded", b));
}

ByteLevelBpe::~ByteLevelBpe() = default;

std::vector<std::string> ByteLevelBpe::pre_tokenize(const std::string& text) const {
  std::vector<std::string> out;
  pre_->split(text, out);
  return out;
}

std::vector<int32_t> ByteLevelBpe::bpe(const std::string& piece) const {
  if (ignore_merges_) {
    const auto whole = vocab_.find(piece);
    if (whole != vocab_.end()) return {whole->second};
  }
  std::vector<std::string> symbols;
  for (size_t i = 0; i < piece.size();) {
    const size_t n = utf8_length(uint8_t(piece[i]));
    symbols.push_back(piece.substr(i, n));
    i += n;
  }
  // The lowest-ranked adjacent pair is merged first, everywhere it occurs.
  for (;;) {
    int32_t best = INT32_MAX;
    for (size_t i = 0; i + 1 < symbols.size(); ++i) {
      const auto r = ranks_.find(symbols[i] + '\x01' + symbols[i + 1]);
      if (r != ranks_.end()) best = std::min(best, r->second);
    }
    if (best == INT32_MAX) break;
    std::vector<std::string> merged;
    for (size_t i = 0; i < symbols.size(); ++i) {
      if (i + 1 < symbols.size()) {
        const auto r = ranks_.find(symbols[i] + '\x01' + symbols[i + 1]);
        if (r != ranks_.end() && r->second == best) {
          merged.push_back(symbols[i] + symbols[i + 1]);
          ++i;
          continue;
        }
      }
      merged.push_back(symbols[i]);
    }
    symbols = std::move(merged);
  }
  std::vector<int32_t> ids;
  for (const auto& s : symbols) {
    const auto id = vocab_.find(s);
    if (id == vocab_.end())  // a lone byte: merges only make tokens of the vocabulary
      throw std::runtime_error(fmt::format("the text holds byte 0x{:02x}, which this vocabulary has no token for",
                                           ByteLevelTables::get().bytes.at(s)));
    ids.push_back(id->second);
  }
  return ids;
}

std::vector<int32_t> ByteLevelBpe::encode(const std::string& text) const {
  const auto& table = ByteLevelTables::get();
  std::vector<int32_t> ids;
  auto encode_plain = [&](const std::string& segment) {
    if (segment.empty()) return;
    for (const auto& piece : pre_tokenize(segment)) {
      std::string chars;
      for (char c : piece) chars += table.chars[uint8_t(c)];
      const auto part = bpe(chars);
      ids.insert(ids.end(), part.begin(), part.end());
    }
  };
  // Added tokens are cut out first, the longest at the leftmost position.
  size_t plain_from = 0;
  for (size_t at = 0; at < text.size();) {
    int32_t found = -1;
    size_t length = 0;
    if (!added_.empty()) {
      auto it = added_.lower_bound(text.substr(at, 1));
      for (; it != added_.end() && it->first[0] == text[at]; ++it)
        if (it->first.size() > length && text.compare(at, it->first.size(), it->first) == 0) {
          found = it->second;
          length = it->first.size();
        }
    }
    if (found < 0) {
      ++at;
      continue;
    }
    encode_plain(text.substr(plain_from, at - plain_from));
    ids.push_back(found);
    at += length;
    plain_from = at;
  }
  encode_plain(text.substr(plain_from));
  return ids;
}

std::string ByteLevelBpe::decode(const std::vector<int32_t>& ids) const {
  const auto& table = ByteLevelTables::get();
  std::string out;
  for (const int32_t id : ids) {
    // As the tokenizers library: an id that names no token (a model's
    // vocabulary may be padded past the tokenizer's) decodes to nothing.
    if (id < 0 || id >= vocab_size_ || tokens_[size_t(id)].empty()) continue;
    const auto& token = tokens_[size_t(id)];
    if (is_added_[size_t(id)]) {
      out += token;
      continue;
    }
    for (size_t i = 0; i < token.size();) {
      const size_t n = utf8_length(uint8_t(token[i]));
      const auto byte = table.bytes.find(token.substr(i, n));
      if (byte != table.bytes.end()) out.push_back(char(byte->second));
      else out += token.substr(i, n);  // not a byte-level character: as it is
      i += n;
    }
  }
  return out;
}

// Runs, checkpoints and `prepare` keep the files as a Hugging Face directory
// holds them, so that transformers pointed at any of them reads this tokenizer.
void ByteLevelBpe::save(const std::string& dir) const { save_hf(dir); }

void ByteLevelBpe::save_hf(const std::string& dir) const {
  write_file_atomic(dir + "/tokenizer.json", json_);
  write_file_atomic(dir + "/tokenizer_config.json",
                    config_.empty() ? Json{{"tokenizer_class", "PreTrainedTokenizerFast"},
                                           {"clean_up_tokenization_spaces", false}}
                                          .dump(2)
                                    : config_);
}

bool is_hf_tokenizer_json(const std::string& path) {
  if (!file_exists(path)) return false;
  const auto j = Json::parse(read_file(path), nullptr, false);
  return j.is_object() && j.contains("model") && !j.contains("type");
}

}  // namespace noloco
