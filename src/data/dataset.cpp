#include "data/dataset.h"

#include <filesystem>

#include <fmt/format.h>

#include "data/token_file.h"
#include "util/files.h"
#include "util/splitmix.h"

namespace noloco {

namespace {

torch::Tensor to_tensor(const std::vector<int32_t>& ids) {
  auto t = torch::empty({int64_t(ids.size())}, torch::kInt64);
  auto* p = t.data_ptr<int64_t>();
  for (size_t i = 0; i < ids.size(); ++i) p[i] = ids[i];
  return t;
}


// The tokenizer of the model the run starts from (init_from), if it holds one.
std::unique_ptr<Tokenizer> model_tokenizer(const DataConfig& c) {
  if (c.model_dir.empty() || !holds_tokenizer(c.model_dir)) return nullptr;
  return load_tokenizer(c.model_dir);
}

std::unique_ptr<Tokenizer> build_tokenizer(const DataConfig& c, const std::string& text) {
  if (auto t = model_tokenizer(c)) return t;
  if (!c.model_dir.empty())
    throw std::invalid_argument(fmt::format(
        "init_from {} has no tokenizer (tokenizer.model or a byte-level BPE tokenizer.json): name one with "
        "tokenizer=, or train on tokens prepared with it (data=FILE.bin)",
        c.model_dir));
  if (c.tokenizer == "char") return make_char_tokenizer(text);
  if (c.tokenizer == "bpe") return train_bpe_tokenizer({c.path}, c.vocab_size);
  return open_tokenizer(c.tokenizer);
}

}  // namespace

Corpus load_corpus(const DataConfig& c, int64_t context, const std::string& run_dir) {
  for (const auto& path : {c.path, c.val_path})
    if (!path.empty() && std::filesystem::is_directory(path))
      throw std::invalid_argument(fmt::format("data file '{}' is a directory; give a text or token file", path));
  Corpus corpus;
  const bool saved = !run_dir.empty() && file_exists(run_dir + "/tokenizer.json");
  torch::Tensor all;
  if (ends_with(c.path, ".bin")) {
    const auto tokens = read_token_file(c.path);
    if (saved) {
      corpus.tokenizer = load_tokenizer(run_dir);
    } else if (auto t = model_tokenizer(c)) {
      corpus.tokenizer = std::move(t);
    } else if (c.tokenizer == "char" || c.tokenizer == "bpe") {
      corpus.tokenizer = make_id_tokenizer(c.vocab_size);
    } else {
      corpus.tokenizer = open_tokenizer(c.tokenizer);
    }
    all = to_tensor(tokens);
  } else {
    const auto text = read_file(c.path);
    if (text.empty()) throw std::invalid_argument(fmt::format("data file '{}' is empty", c.path));
    corpus.tokenizer = saved ? load_tokenizer(run_dir) : build_tokenizer(c, text);
    all = to_tensor(corpus.tokenizer->encode(text));
  }
  if (!saved && !run_dir.empty()) {
    std::filesystem::create_directories(run_dir);
    corpus.tokenizer->save(run_dir);
  }
  const int64_t vocab = corpus.tokenizer->vocab_size();
  // Checked here, before any worker starts, not at the first evaluation.
  const auto check_ids = [vocab](const std::string& path, const torch::Tensor& ids) {
    if (ids.numel() > 0 && ids.max().item<int64_t>() >= vocab)
      throw std::invalid_argument(
          fmt::format("'{}' holds token id {} outside the vocabulary of {}", path, ids.max().item<int64_t>(), vocab));
  };
  check_ids(c.path, all);
  if (!c.val_path.empty()) {
    corpus.train = all;
    corpus.val = to_tensor(read_token_file(c.val_path));
    check_ids(c.val_path, corpus.val);
  } else {
    const int64_t n_val = int64_t(double(all.numel()) * c.val_fraction);
    corpus.train = all.narrow(0, 0, all.numel() - n_val);
    corpus.val = all.narrow(0, all.numel() - n_val, n_val);
  }
  const int64_t need = context + 1;
  if (corpus.train.numel() < need || corpus.val.numel() < need)
    throw std::invalid_argument(fmt::format(
        "corpus '{}' is too short: {} training and {} validation tokens, but one block needs {}", c.path,
        corpus.train.numel(), corpus.val.numel(), need));
  return corpus;
}

ModelConfig with_vocabulary(ModelConfig model, const Tokenizer& tokenizer) {
  if (model.vocab_size == 0) {
    model.vocab_size = tokenizer.vocab_size();
  } else if (tokenizer.vocab_size() > model.vocab_size) {
    throw std::invalid_argument(fmt::format("the tokenizer's {} tokens do not fit the model's vocabulary of {}",
                                            tokenizer.vocab_size(), model.vocab_size));
  }
  return model;
}

WindowSampler::WindowSampler(torch::Tensor tokens, int64_t context, uint64_t seed)
    : tokens_(std::move(tokens)), context_(context), seed_(seed) {}

Batch WindowSampler::sample(uint64_t index, int64_t first, int64_t count) const {
  const uint64_t starts = uint64_t(tokens_.numel() - context_);  // valid window starts
  auto inputs = torch::empty({count, context_}, torch::kInt64);
  auto targets = torch::empty({count, context_}, torch::kInt64);
  const auto* src = tokens_.data_ptr<int64_t>();
  auto* x = inputs.data_ptr<int64_t>();
  auto* y = targets.data_ptr<int64_t>();
  for (int64_t r = 0; r < count; ++r) {
    const uint64_t key = splitmix64(splitmix64(seed_ ^ splitmix64(index)) + uint64_t(first + r));
    const uint64_t start = key % starts;
    std::copy(src + start, src + start + context_, x + r * context_);
    std::copy(src + start + 1, src + start + 1 + context_, y + r * context_);
  }
  return {inputs, targets};
}

}  // namespace noloco
