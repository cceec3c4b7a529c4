#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>

#include "test_util.h"
#include "util/tensorboard.h"

using namespace noloco;

namespace {

// Bit-by-bit CRC-32C, independent of the table-driven one under test.
uint32_t slow_crc32c(const std::string& s) {
  uint32_t c = 0xffffffffu;
  for (unsigned char b : s) {
    c ^= b;
    for (int k = 0; k < 8; ++k) c = (c >> 1) ^ (0x82F63B78u & (0u - (c & 1u)));
  }
  return ~c;
}
uint32_t slow_masked(const std::string& s) {
  const uint32_t c = slow_crc32c(s);
  return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

template <class T>
T read_le(const std::string& s, size_t at) {
  T v;
  std::memcpy(&v, s.data() + at, sizeof(T));
  return v;
}

uint64_t varint(const std::string& s, size_t& at) {
  uint64_t v = 0;
  for (int shift = 0;; shift += 7) {
    const uint8_t b = uint8_t(s.at(at++));
    v |= uint64_t(b & 0x7f) << shift;
    if (!(b & 0x80)) return v;
  }
}

struct Scalar {
  int64_t step = -1;
  std::string tag, file_version;
  float value = 0;
};

// Minimal protobuf reader for Event{wall_time=1, step=2, file_version=3, summary=5{value=1{tag=1, simple_value=2}}}.
Scalar decode_event(const std::string& e) {
  Scalar out;
  size_t at = 0;
  while (at < e.size()) {
    const uint64_t key = varint(e, at);
    const int field = int(key >> 3), wire = int(key & 7);
    if (wire == 1) {
      at += 8;
    } else if (wire == 0) {
      const uint64_t v = varint(e, at);
      if (field == 2) out.step = int64_t(v);
    } else if (wire == 2) {
      const size_t len = size_t(varint(e, at));
      const std::string body = e.substr(at, len);
      at += len;
      if (field == 3) out.file_version = body;
      if (field == 5) {  // Summary -> Value
        size_t p = 0;
        EXPECT_EQ(varint(body, p), (1u << 3) | 2u);
        const size_t value_len = size_t(varint(body, p));
        const std::string value = body.substr(p, value_len);
        size_t q = 0;
        EXPECT_EQ(varint(value, q), (1u << 3) | 2u);
        const size_t tag_len = size_t(varint(value, q));
        out.tag = value.substr(q, tag_len);
        q += tag_len;
        EXPECT_EQ(varint(value, q), (2u << 3) | 5u);
        out.value = read_le<float>(value, q);
      }
    } else {
      ADD_FAILURE() << "unexpected wire type " << wire;
      return out;
    }
  }
  return out;
}

}  // namespace

TEST(TensorBoard, Crc32cCheckValue) {
  EXPECT_EQ(crc32c("123456789"), 0xE3069283u);  // the standard CRC-32C check value
  EXPECT_EQ(crc32c("noloco"), slow_crc32c("noloco"));
}

TEST(TensorBoard, EventFileFramingCrcTagsAndValues) {
  noloco::testing::TempDir dir;
  std::string path;
  {
    EventWriter w(dir / "tb", "r3");
    w.scalar("train/loss", 10, 2.5);
    w.scalar("val/loss", 20, 1.75);
    path = w.path();
  }
  EXPECT_NE(std::filesystem::path(path).filename().string().find("events.out.tfevents."), std::string::npos);
  const std::string bytes = noloco::testing::read_text(path);
  std::vector<Scalar> events;
  size_t at = 0;
  while (at < bytes.size()) {
    ASSERT_LE(at + 12, bytes.size());
    const std::string len_bytes = bytes.substr(at, 8);
    const uint64_t len = read_le<uint64_t>(bytes, at);
    EXPECT_EQ(read_le<uint32_t>(bytes, at + 8), slow_masked(len_bytes));
    ASSERT_LE(at + 12 + len + 4, bytes.size());
    const std::string data = bytes.substr(at + 12, len);
    EXPECT_EQ(read_le<uint32_t>(bytes, at + 12 + len), slow_masked(data));
    events.push_back(decode_event(data));
    at += 12 + len + 4;
  }
  ASSERT_EQ(events.size(), 3u);
  EXPECT_EQ(events[0].file_version, "brain.Event:2");
  EXPECT_EQ(events[1].tag, "train/loss");
  EXPECT_EQ(events[1].step, 10);
  EXPECT_FLOAT_EQ(events[1].value, 2.5f);
  EXPECT_EQ(events[2].tag, "val/loss");
  EXPECT_EQ(events[2].step, 20);
  EXPECT_FLOAT_EQ(events[2].value, 1.75f);
}
