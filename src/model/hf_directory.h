// A Hugging Face LlamaForCausalLM directory: config.json, the weights as
// model.safetensors or as shards listed in model.safetensors.index.json, and
// the tokenizer. What `init_from=`, `generate HF_DIR` and `export` read and write.
#pragma once
#include <cstdint>
#include <string>

#include "config/model_config.h"
#include "model/llama.h"
#include "util/tensor_map.h"

namespace noloco {

// A run's copy of the config.json of the model it started from (init_from),
// beside its config.yaml: what `export` writes back.
constexpr const char* kImportedHfConfig = "init_from_config.json";

// Whether `dir` holds a config.json (and so is read as a Hugging Face directory).
bool is_hf_directory(const std::string& dir);
// The weights of `config`, in fp32 whatever the files hold (fp32, bf16, fp16).
// Every name and shape is checked against the config, the index against the
// shards (a missing shard, a tensor in two shards or in another shard than the
// index says); a tied directory read into an untied `config` gets its
// lm_head copied from the embeddings. Throws
// std::runtime_error naming the directory, the file and the tensor.
TensorMap read_hf_weights(const std::string& dir, const ModelConfig& config);
// The model of read_hf_config with read_hf_weights loaded into it.
void load_hf_weights(LlamaForCausalLM& model, const std::string& dir);
// Writes the weights in `dtype`: model.safetensors when they fit in one shard
// of `shard_bytes`, else model-0000k-of-0000n.safetensors and the index.
// Weight files of an earlier export in `dir` are removed first.
void write_hf_weights(const std::string& dir, const TensorMap& weights, uint64_t shard_bytes,
                      torch::ScalarType dtype);
// Removes the weight files (model.safetensors, its shards and index) in `dir`.
void remove_hf_weights(const std::string& dir);

}  // namespace noloco
