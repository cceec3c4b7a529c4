// The safetensors format: 8-byte little-endian header length, a JSON header
// {name: {dtype, shape, data_offsets}, "__metadata__": {str: str}}, then raw
// little-endian tensor bytes. Torch-free, so it can be fuzzed on its own.
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

namespace noloco {

struct SafeTensor {
  std::string dtype;  // "F32", "F64", "BF16", "F16", "I64", "I32", "U16", "U8", ...
  std::vector<int64_t> shape;
  std::string_view data;  // points into SafetensorsFile::bytes
};

// Bytes per element for a dtype name, 0 if unknown.
size_t safetensors_dtype_size(std::string_view dtype);

struct SafetensorsFile {
  std::map<std::string, std::string> metadata;
  std::map<std::string, SafeTensor> tensors;
  std::string bytes;  // owns the buffer the tensors point into
};

// Parses and validates everything (sizes, offsets, dtypes, overlap); throws
// std::runtime_error with a one-line reason. Never reads out of bounds.
SafetensorsFile parse_safetensors(std::string bytes);
SafetensorsFile load_safetensors(const std::string& path);

class SafetensorsWriter {
 public:
  void add(const std::string& name, const std::string& dtype, std::vector<int64_t> shape,
           const void* data, size_t nbytes);
  void set_metadata(const std::string& key, const std::string& value) { metadata_[key] = value; }
  std::string serialize() const;
  void write_atomic(const std::string& path) const;

 private:
  struct Entry {
    std::string dtype;
    std::vector<int64_t> shape;
    std::string bytes;
  };
  std::map<std::string, Entry> entries_;
  std::map<std::string, std::string> metadata_;
};

}  // namespace noloco
