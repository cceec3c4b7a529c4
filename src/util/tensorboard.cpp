#include "util/tensorboard.h"

#include "util/crc32c.h"
#include "util/process_stats.h"

#include <unistd.h>

#include <array>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <stdexcept>

#include <fmt/format.h>

namespace noloco {

namespace {

void put_varint(std::string& out, uint64_t v) {
  while (v >= 0x80) {
    out.push_back(char((v & 0x7f) | 0x80));
    v >>= 7;
  }
  out.push_back(char(v));
}

template <class T>
void put_fixed(std::string& out, T v) {
  char bytes[sizeof(T)];
  std::memcpy(bytes, &v, sizeof(T));  // protobuf fixed fields are little-endian, as is x86/ARM
  out.append(bytes, sizeof(T));
}

void put_bytes_field(std::string& out, int field, std::string_view bytes) {
  put_varint(out, uint64_t(field) << 3 | 2);
  put_varint(out, bytes.size());
  out.append(bytes);
}

std::string event_header(double wall_time, int64_t step) {
  std::string e;
  put_varint(e, 1 << 3 | 1);  // Event.wall_time: double
  put_fixed(e, wall_time);
  put_varint(e, 2 << 3 | 0);  // Event.step: int64
  put_varint(e, uint64_t(step));
  return e;
}

}  // namespace

uint32_t masked_crc32c(std::string_view data) {
  const uint32_t c = crc32c(data);
  return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

EventWriter::EventWriter(const std::string& dir, const std::string& suffix) {
  std::filesystem::create_directories(dir);
  path_ = fmt::format("{}/events.out.tfevents.{}.{}.{}.{}", dir, int64_t(unix_seconds()), machine_name(), ::getpid(),
                      suffix);
  file_ = std::fopen(path_.c_str(), "wb");
  if (!file_) throw std::runtime_error(fmt::format("cannot create '{}': {}", path_, std::strerror(errno)));
  std::string first = event_header(unix_seconds(), 0);
  put_bytes_field(first, 3, "brain.Event:2");  // Event.file_version
  write_record(first);
  flush();
}

EventWriter::~EventWriter() {
  if (file_) std::fclose(file_);
}

void EventWriter::scalar(const std::string& tag, int64_t step, double value) {
  std::string summary_value;
  put_bytes_field(summary_value, 1, tag);  // Summary.Value.tag
  put_varint(summary_value, 2 << 3 | 5);   // Summary.Value.simple_value: float
  put_fixed(summary_value, float(value));
  std::string summary;
  put_bytes_field(summary, 1, summary_value);  // Summary.value
  std::string event = event_header(unix_seconds(), step);
  put_bytes_field(event, 5, summary);  // Event.summary
  write_record(event);
}

void EventWriter::write_record(const std::string& event) {
  std::string record;
  std::string length;
  put_fixed(length, uint64_t(event.size()));
  record += length;
  put_fixed(record, masked_crc32c(length));
  record += event;
  put_fixed(record, masked_crc32c(event));
  if (std::fwrite(record.data(), 1, record.size(), file_) != record.size())
    throw std::runtime_error(fmt::format("cannot write '{}': {}", path_, std::strerror(errno)));
}

void EventWriter::flush() { std::fflush(file_); }

}  // namespace noloco
