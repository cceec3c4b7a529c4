#include "data/tokenizer.h"

#include <array>
#include <cstdlib>
#include <stdexcept>

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <dlfcn.h>
#include <sys/stat.h>
#include <unistd.h>

#include "data/byte_level_bpe.h"
#include "data/spm_module.h"

#include "util/files.h"

namespace noloco {

namespace {

constexpr const char* kOwnDescription = "tokenizer.json";    // in run and checkpoint directories
constexpr const char* kHfDescription = "noloco_tokenizer.json";  // in exported directories

class CharTokenizer : public Tokenizer {
 public:
  explicit CharTokenizer(std::string chars) : chars_(std::move(chars)) {
    index_.fill(-1);
    for (size_t i = 0; i < chars_.size(); ++i) index_[uint8_t(chars_[i])] = int32_t(i);
  }
  std::string kind() const override { return "char"; }
  int64_t vocab_size() const override { return int64_t(chars_.size()); }
  std::vector<int32_t> encode(const std::string& text) const override {
    std::vector<int32_t> ids;
    ids.reserve(text.size());
    for (char c : text) {
      int32_t id = index_[uint8_t(c)];
      if (id < 0)
        throw std::invalid_argument(fmt::format("character 0x{:02x} is not in the vocabulary", uint8_t(c)));
      ids.push_back(id);
    }
    return ids;
  }
  std::string decode(const std::vector<int32_t>& ids) const override {
    std::string s;
    for (auto id : ids) s.push_back(id >= 0 && id < int32_t(chars_.size()) ? chars_[size_t(id)] : '?');
    return s;
  }
  void save(const std::string& dir) const override { write_json_atomic(dir + "/" + kOwnDescription, description()); }
  void save_hf(const std::string& dir) const override {
    write_json_atomic(dir + "/" + kHfDescription, description());
    // A BPE without merges over byte-level characters maps each byte to its id.
    nlohmann::json vocab = nlohmann::json::object();
    for (size_t i = 0; i < chars_.size(); ++i) vocab[byte_level_char(uint8_t(chars_[i]))] = i;
    const nlohmann::json byte_level = {
        {"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", false}, {"use_regex", false}};
    write_json_atomic(dir + "/tokenizer.json",
                      {{"version", "1.0"},
                       {"truncation", nullptr},
                       {"padding", nullptr},
                       {"added_tokens", nlohmann::json::array()},
                       {"normalizer", nullptr},
                       {"pre_tokenizer", byte_level},
                       {"post_processor", nullptr},
                       {"decoder", byte_level},
                       {"model",
                        {{"type", "BPE"},
                         {"dropout", nullptr},
                         {"unk_token", nullptr},
                         {"continuing_subword_prefix", nullptr},
                         {"end_of_word_suffix", nullptr},
                         {"fuse_unk", false},
                         {"byte_fallback", false},
                         {"vocab", vocab},
                         {"merges", nlohmann::json::array()}}}});
    write_json_atomic(dir + "/tokenizer_config.json",
                      {{"tokenizer_class", "PreTrainedTokenizerFast"}, {"clean_up_tokenization_spaces", false}});
  }

 private:
  nlohmann::json description() const {
    // Byte values: the vocabulary need not be valid UTF-8.
    std::vector<int> bytes(chars_.begin(), chars_.end());
    for (auto& b : bytes) b = uint8_t(b);
    return {{"type", "char"}, {"bytes", bytes}};
  }
  std::string chars_;
  std::array<int32_t, 256> index_{};
};

// Resolves the sentencepiece module once (see spm_module.h for why it is a module).
struct SpmApi {
  decltype(&noloco_spm_train) train;
  decltype(&noloco_spm_load) load;
  decltype(&noloco_spm_free) free;
  decltype(&noloco_spm_encode) encode;
  decltype(&noloco_spm_decode) decode;
  decltype(&noloco_spm_piece_size) piece_size;
  decltype(&noloco_spm_eos) eos;

  static const SpmApi& get() {
    static const SpmApi api = open();
    return api;
  }

 private:
  static SpmApi open() {
    std::string path;
    if (const char* env = std::getenv("NOLOCO_SPM_MODULE")) {
      path = env;
    } else {
      char exe[4096];
      const ssize_t n = ::readlink("/proc/self/exe", exe, sizeof exe - 1);
      std::string dir = n > 0 ? std::string(exe, size_t(n)) : std::string("./x");
      path = dir.substr(0, dir.rfind('/')) + "/libnoloco_spm.so";
    }
    void* h = ::dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL | RTLD_DEEPBIND);
    if (!h) throw std::runtime_error(fmt::format("cannot load the sentencepiece module: {}", ::dlerror()));
    SpmApi api{};
    auto sym = [&](const char* name) {
      void* f = ::dlsym(h, name);
      if (!f) throw std::runtime_error(fmt::format("{} lacks {}", path, name));
      return f;
    };
    api.train = reinterpret_cast<decltype(api.train)>(sym("noloco_spm_train"));
    api.load = reinterpret_cast<decltype(api.load)>(sym("noloco_spm_load"));
    api.free = reinterpret_cast<decltype(api.free)>(sym("noloco_spm_free"));
    api.encode = reinterpret_cast<decltype(api.encode)>(sym("noloco_spm_encode"));
    api.decode = reinterpret_cast<decltype(api.decode)>(sym("noloco_spm_decode"));
    api.piece_size = reinterpret_cast<decltype(api.piece_size)>(sym("noloco_spm_piece_size"));
    api.eos = reinterpret_cast<decltype(api.eos)>(sym("noloco_spm_eos"));
    return api;
  }
};

class SentencePieceTokenizer : public Tokenizer {
 public:
  explicit SentencePieceTokenizer(std::string serialized) : serialized_(std::move(serialized)) {
    std::string error;
    sp_ = SpmApi::get().load(&serialized_, &error);
    if (!sp_) throw std::runtime_error("invalid sentencepiece model: " + error);
    vocab_ = SpmApi::get().piece_size(sp_);
    std::string piece;
    const int eos = SpmApi::get().eos(sp_, &piece);
    if (eos >= 0 && !piece.empty()) eos_ = EndOfText{eos, piece};
  }
  ~SentencePieceTokenizer() override { SpmApi::get().free(sp_); }
  SentencePieceTokenizer(const SentencePieceTokenizer&) = delete;
  SentencePieceTokenizer& operator=(const SentencePieceTokenizer&) = delete;
  std::string kind() const override { return "sentencepiece"; }
  int64_t vocab_size() const override { return vocab_; }
  std::optional<EndOfText> end_of_text() const override { return eos_; }
  std::vector<int32_t> encode(const std::string& text) const override {
    std::vector<int> ids;
    std::string error;
    if (SpmApi::get().encode(sp_, &text, &ids, &error) != 0)
      throw std::invalid_argument("sentencepiece encode: " + error);
    return {ids.begin(), ids.end()};
  }
  std::string decode(const std::vector<int32_t>& ids) const override {
    std::vector<int> v;
    for (auto id : ids) v.push_back(id >= 0 && id < vocab_ ? id : 0);
    std::string out, error;
    if (SpmApi::get().decode(sp_, &v, &out, &error) != 0) throw std::runtime_error("sentencepiece decode: " + error);
    return out;
  }
  void save(const std::string& dir) const override {
    write_file_atomic(dir + "/tokenizer.model", serialized_);
    write_json_atomic(dir + "/" + kOwnDescription, {{"type", "sentencepiece"}, {"model", "tokenizer.model"}});
  }
  void save_hf(const std::string& dir) const override {
    write_file_atomic(dir + "/tokenizer.model", serialized_);
    // Text is encoded as noloco trained on it: no BOS/EOS added. The special
    // pieces are sentencepiece's (and Llama's) defaults.
    write_json_atomic(dir + "/tokenizer_config.json", {{"tokenizer_class", "LlamaTokenizer"},
                                                       {"add_bos_token", false},
                                                       {"add_eos_token", false},
                                                       {"unk_token", "<unk>"},
                                                       {"bos_token", "<s>"},
                                                       {"eos_token", "</s>"},
                                                       {"legacy", true},
                                                       {"clean_up_tokenization_spaces", false}});
  }

 private:
  std::string serialized_;
  void* sp_ = nullptr;
  int64_t vocab_ = 0;
  std::optional<EndOfText> eos_;
};

class IdTokenizer : public Tokenizer {
 public:
  explicit IdTokenizer(int64_t vocab) : vocab_(vocab) {}
  std::string kind() const override { return "ids"; }
  int64_t vocab_size() const override { return vocab_; }
  std::vector<int32_t> encode(const std::string& text) const override {
    std::vector<int32_t> ids;
    size_t pos = 0;
    while (pos < text.size()) {
      size_t used = 0;
      long v = 0;
      try {
        v = std::stol(text.substr(pos), &used);
      } catch (const std::exception&) {
        throw std::invalid_argument("prompt must be space-separated token ids without a tokenizer");
      }
      if (v < 0 || v >= vocab_) throw std::invalid_argument(fmt::format("token id {} out of range", v));
      ids.push_back(int32_t(v));
      pos += used;
      while (pos < text.size() && text[pos] == ' ') ++pos;
    }
    return ids;
  }
  std::string decode(const std::vector<int32_t>& ids) const override {
    std::string s;
    for (auto id : ids) s += fmt::format("{} ", id);
    return s;
  }
  void save(const std::string& dir) const override {
    write_json_atomic(dir + "/" + kOwnDescription, {{"type", "ids"}, {"vocab_size", vocab_}});
  }
  void save_hf(const std::string& dir) const override {
    write_json_atomic(dir + "/" + kHfDescription, {{"type", "ids"}, {"vocab_size", vocab_}});
  }

 private:
  int64_t vocab_;
};

}  // namespace

std::unique_ptr<Tokenizer> make_char_tokenizer(const std::string& text) {
  std::array<bool, 256> seen{};
  for (char c : text) seen[uint8_t(c)] = true;
  std::string chars;
  for (int c = 0; c < 256; ++c)
    if (seen[size_t(c)]) chars.push_back(char(c));
  if (chars.empty()) throw std::invalid_argument("cannot build a vocabulary from empty text");
  return std::make_unique<CharTokenizer>(chars);
}

std::unique_ptr<Tokenizer> train_bpe_tokenizer(const std::vector<std::string>& text_paths, int64_t vocab_size) {
  std::string inputs;
  for (const auto& path : text_paths) {
    if (path.find(',') != std::string::npos)
      throw std::invalid_argument(fmt::format("cannot train a tokenizer on '{}': sentencepiece lists its inputs "
                                              "comma-separated, so the file name must not contain a comma", path));
    inputs += (inputs.empty() ? "" : ",") + path;
  }
  std::string serialized, error;
  const std::string args = fmt::format(
      "--input={} --model_type=bpe --vocab_size={} --character_coverage=1.0 "
      "--byte_fallback=true --split_digits=true --num_threads=2 --minloglevel=2 "
      "--remove_extra_whitespaces=false --normalization_rule_name=identity "
      "--input_sentence_size=1000000 --shuffle_input_sentence=true",
      inputs, vocab_size);
  if (SpmApi::get().train(&args, &serialized, &error) != 0)
    throw std::runtime_error("training the BPE tokenizer failed: " + error);
  return std::make_unique<SentencePieceTokenizer>(serialized);
}

std::unique_ptr<Tokenizer> load_sentencepiece(const std::string& model_path) {
  return std::make_unique<SentencePieceTokenizer>(read_file(model_path));
}

std::unique_ptr<Tokenizer> make_id_tokenizer(int64_t vocab_size) {
  if (vocab_size <= 0) throw std::invalid_argument("vocab_size must be set for pre-tokenized data");
  return std::make_unique<IdTokenizer>(vocab_size);
}

namespace {

std::unique_ptr<Tokenizer> described_tokenizer(const std::string& dir, const std::string& file,
                                               const nlohmann::json& j) {
  const auto where = dir + "/" + file;
  const auto type = j.value("type", "");
  if (type == "char") {
    std::string chars;
    std::array<bool, 256> seen{};
    const auto& bytes = j.value("bytes", nlohmann::json());
    if (!bytes.is_array() || bytes.empty())
      throw std::runtime_error(fmt::format("{}: 'bytes' must be a non-empty list", where));
    for (auto& b : bytes) {
      if (!b.is_number_integer() || b.get<int64_t>() < 0 || b.get<int64_t>() > 255 || seen[size_t(b.get<int64_t>())])
        throw std::runtime_error(fmt::format("{}: {} is not a new byte value (0..255)", where, b.dump()));
      seen[size_t(b.get<int64_t>())] = true;
      chars.push_back(char(b.get<int>()));
    }
    return std::make_unique<CharTokenizer>(chars);
  }
  if (type == "sentencepiece") return load_sentencepiece(dir + "/" + j.at("model").get<std::string>());
  if (type == "byte_level_bpe") return load_byte_level_bpe(dir, j.at("file").get<std::string>());
  if (type == "ids") {
    const auto& v = j.value("vocab_size", nlohmann::json());
    if (!v.is_number_integer() || v.get<int64_t>() < 1 || v.get<int64_t>() > (int64_t(1) << 31))
      throw std::runtime_error(fmt::format("{}: vocab_size must be in [1, 2^31]", where));
    return make_id_tokenizer(v.get<int64_t>());
  }
  throw std::runtime_error(fmt::format("{}: unknown tokenizer type '{}'", where, type));
}

constexpr const char* kSentencePieceModel = "tokenizer.model";
// A Hugging Face directory's tokenizer.json is the tokenizers library's (no
// "type" at the top), not ours: same name, told apart by what it holds.
constexpr const char* kHfTokenizersFile = "tokenizer.json";

// The file of `dir` that load_tokenizer reads, in its order of preference; empty if none.
std::string tokenizer_file(const std::string& dir) {
  if (file_exists(dir + "/" + kHfDescription)) return kHfDescription;
  if (file_exists(dir + "/" + kOwnDescription)) {
    const auto j = read_json(dir + "/" + kOwnDescription);
    if (j.is_object() && j.contains("type")) return kOwnDescription;
  }
  if (file_exists(dir + "/" + kSentencePieceModel)) return kSentencePieceModel;
  if (is_hf_tokenizer_json(dir + "/" + kHfTokenizersFile)) return kHfTokenizersFile;
  return "";
}

}  // namespace

std::unique_ptr<Tokenizer> load_byte_level_bpe(const std::string& dir, const std::string& file) {
  // The tokenizer_config.json that came with it (special tokens, chat template) travels along.
  const std::string config = file == kHfTokenizersFile ? "tokenizer_config.json" : "hf_tokenizer_config.json";
  return std::make_unique<ByteLevelBpe>(read_file(dir + "/" + file),
                                        file_exists(dir + "/" + config) ? read_file(dir + "/" + config) : "",
                                        dir + "/" + file);
}

const std::vector<std::string>& tokenizer_files() {
  static const std::vector<std::string> files = {kOwnDescription, kHfDescription, kSentencePieceModel,
                                                 "tokenizer_config.json", "hf_tokenizer.json",
                                                 "hf_tokenizer_config.json"};
  return files;
}

bool holds_tokenizer(const std::string& dir) { return !tokenizer_file(dir).empty(); }

std::unique_ptr<Tokenizer> load_tokenizer(const std::string& dir) {
  const auto file = tokenizer_file(dir);
  if (file.empty())
    throw std::runtime_error(fmt::format(
        "{} holds no tokenizer noloco reads (a sentencepiece tokenizer.model, a byte-level BPE tokenizer.json, or "
        "noloco's own tokenizer.json)",
        dir));
  if (file == kSentencePieceModel) return load_sentencepiece(dir + "/" + file);
  if (file == kHfTokenizersFile && is_hf_tokenizer_json(dir + "/" + file)) return load_byte_level_bpe(dir, file);
  return described_tokenizer(dir, file, read_json(dir + "/" + file));
}

std::unique_ptr<Tokenizer> open_tokenizer(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) return load_tokenizer(path);
  if (!ends_with(path, ".json")) return load_sentencepiece(path);
  // A tokenizer.json named as a file: the tokenizers library's, or noloco's own.
  const auto j = nlohmann::json::parse(read_file(path), nullptr, false);
  if (j.is_discarded() || !j.is_object())
    throw std::runtime_error(fmt::format("{} is not a tokenizer.json: not a JSON object (cut short?)", path));
  const auto slash = path.rfind('/');
  const auto dir = slash == std::string::npos ? "." : path.substr(0, slash);
  const auto file = slash == std::string::npos ? path : path.substr(slash + 1);
  if (j.contains("type")) return described_tokenizer(dir, file, j);
  return load_byte_level_bpe(dir, file);
}

}  // namespace noloco
