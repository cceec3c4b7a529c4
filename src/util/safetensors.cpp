#include "util/safetensors.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "util/files.h"

namespace noloco {

namespace {
[[noreturn]] void bad(const std::string& why) {
  throw std::runtime_error("invalid safetensors: " + why);
}
// Headers above this are not something we wrote; refusing them bounds memory.
constexpr uint64_t kMaxHeader = 100u << 20;
}  // namespace

size_t safetensors_dtype_size(std::string_view d) {
  if (d == "F64" || d == "I64" || d == "U64") return 8;
  if (d == "F32" || d == "I32" || d == "U32") return 4;
  if (d == "F16" || d == "BF16" || d == "I16" || d == "U16") return 2;
  if (d == "I8" || d == "U8" || d == "BOOL") return 1;
  return 0;
}

SafetensorsFile parse_safetensors(std::string bytes) {
  SafetensorsFile f;
  f.bytes = std::move(bytes);
  const std::string& b = f.bytes;
  if (b.size() < 8) bad(fmt::format("file is {} bytes, shorter than the 8-byte header length", b.size()));
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | uint8_t(b[size_t(i)]);
  if (header_len > kMaxHeader || header_len > b.size() - 8)
    bad(fmt::format("header length {} exceeds the file ({} bytes)", header_len, b.size()));
  auto header = nlohmann::json::parse(b.begin() + 8, b.begin() + 8 + long(header_len), nullptr, false);
  if (header.is_discarded() || !header.is_object()) bad("header is not a JSON object");
  const size_t data_start = 8 + header_len;
  const uint64_t data_size = b.size() - data_start;
  std::vector<std::pair<uint64_t, uint64_t>> ranges;
  for (auto& [name, entry] : header.items()) {
    if (name == "__metadata__") {
      if (!entry.is_object()) bad("__metadata__ is not an object");
      for (auto& [k, v] : entry.items()) {
        if (!v.is_string()) bad(fmt::format("metadata '{}' is not a string", k));
        f.metadata[k] = v.get<std::string>();
      }
      continue;
    }
    if (!entry.is_object()) bad(fmt::format("entry '{}' is not an object", name));
    auto dtype = entry.find("dtype"), shape = entry.find("shape"), offs = entry.find("data_offsets");
    if (dtype == entry.end() || !dtype->is_string()) bad(fmt::format("'{}' has no dtype", name));
    if (shape == entry.end() || !shape->is_array()) bad(fmt::format("'{}' has no shape", name));
    if (offs == entry.end() || !offs->is_array() || offs->size() != 2 ||
        !(*offs)[0].is_number_unsigned() || !(*offs)[1].is_number_unsigned())
      bad(fmt::format("'{}' has no valid data_offsets", name));
    SafeTensor t;
    t.dtype = dtype->get<std::string>();
    const size_t esize = safetensors_dtype_size(t.dtype);
    if (esize == 0) bad(fmt::format("'{}' has unknown dtype '{}'", name, t.dtype));
    uint64_t numel = 1;
    for (auto& d : *shape) {
      if (!d.is_number_unsigned()) bad(fmt::format("'{}' has a non-integer or negative dimension", name));
      const uint64_t dim = d.get<uint64_t>();
      if (dim > 0 && numel > (uint64_t(1) << 62) / dim) bad(fmt::format("'{}' shape overflows", name));
      numel *= dim;
      t.shape.push_back(int64_t(dim));
    }
    const uint64_t begin = (*offs)[0].get<uint64_t>(), end = (*offs)[1].get<uint64_t>();
    if (begin > end || end > data_size)
      bad(fmt::format("'{}' offsets [{}, {}] outside the {} data bytes", name, begin, end, data_size));
    if (end - begin != numel * esize)
      bad(fmt::format("'{}' has {} bytes for {} elements of {}", name, end - begin, numel, t.dtype));
    t.data = std::string_view(b.data() + data_start + begin, end - begin);
    ranges.emplace_back(begin, end);
    f.tensors.emplace(name, std::move(t));
  }
  std::sort(ranges.begin(), ranges.end());
  for (size_t i = 1; i < ranges.size(); ++i)
    if (ranges[i].first < ranges[i - 1].second) bad("tensor data ranges overlap");
  return f;
}

SafetensorsFile load_safetensors(const std::string& path) {
  try {
    return parse_safetensors(read_file(path));
  } catch (const std::runtime_error& e) {
    throw std::runtime_error(fmt::format("{}: {}", path, e.what()));
  }
}

void SafetensorsWriter::add(const std::string& name, const std::string& dtype,
                            std::vector<int64_t> shape, const void* data, size_t nbytes) {
  if (name == "__metadata__") throw std::invalid_argument("reserved tensor name __metadata__");
  entries_[name] = Entry{dtype, std::move(shape), std::string(static_cast<const char*>(data), nbytes)};
}

std::string SafetensorsWriter::serialize() const {
  nlohmann::json header = nlohmann::json::object();
  if (!metadata_.empty()) header["__metadata__"] = metadata_;
  uint64_t offset = 0;
  for (auto& [name, e] : entries_) {
    header[name] = {{"dtype", e.dtype}, {"shape", e.shape}, {"data_offsets", {offset, offset + e.bytes.size()}}};
    offset += e.bytes.size();
  }
  std::string text = header.dump();
  // Pad with spaces so tensor data starts 8-byte aligned, as the reference writer does.
  text.append((8 - text.size() % 8) % 8, ' ');
  std::string out;
  out.reserve(8 + text.size() + offset);
  uint64_t n = text.size();
  for (int i = 0; i < 8; ++i) out.push_back(char((n >> (8 * i)) & 0xff));
  out += text;
  for (auto& [name, e] : entries_) out += e.bytes;
  return out;
}

void SafetensorsWriter::write_atomic(const std::string& path) const {
  write_file_atomic(path, serialize());
}

}  // namespace noloco
