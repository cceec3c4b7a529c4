// TensorBoard event files, written without TensorFlow: TFRecord framing
// (length, masked CRC-32C of the length, data, masked CRC-32C of the data)
// around hand-encoded `Event` protobufs carrying scalar `Summary` values.
#pragma once
#include <cstdint>
#include <cstdio>
#include <string>
#include <string_view>

#include "util/crc32c.h"

namespace noloco {

// TensorFlow's masking, so that CRCs of data containing CRCs stay well-mixed.
uint32_t masked_crc32c(std::string_view data);

class EventWriter {
 public:
  // Creates `dir` and an events.out.tfevents.<time>.<host>.<pid>.<suffix> file in it.
  EventWriter(const std::string& dir, const std::string& suffix);
  ~EventWriter();
  EventWriter(const EventWriter&) = delete;
  EventWriter& operator=(const EventWriter&) = delete;
  void scalar(const std::string& tag, int64_t step, double value);
  void flush();
  const std::string& path() const { return path_; }

 private:
  void write_record(const std::string& event);
  std::string path_;
  std::FILE* file_ = nullptr;
};

}  // namespace noloco
