#include <gtest/gtest.h>

#include <algorithm>
#include <map>

#include <cstring>
#include <filesystem>

#include "test_util.h"
#include "train/telemetry.h"
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

// Every record of an event file, with both CRCs of each checked independently.
std::vector<Scalar> read_events(const std::string& path) {
  const std::string bytes = noloco::testing::read_text(path);
  std::vector<Scalar> events;
  size_t at = 0;
  while (at < bytes.size()) {
    EXPECT_LE(at + 12, bytes.size());
    if (at + 12 > bytes.size()) break;
    const std::string len_bytes = bytes.substr(at, 8);
    const uint64_t len = read_le<uint64_t>(bytes, at);
    EXPECT_EQ(read_le<uint32_t>(bytes, at + 8), slow_masked(len_bytes));
    EXPECT_LE(at + 12 + len + 4, bytes.size());
    if (at + 12 + len + 4 > bytes.size()) break;
    const std::string data = bytes.substr(at + 12, len);
    EXPECT_EQ(read_le<uint32_t>(bytes, at + 12 + len), slow_masked(data));
    events.push_back(decode_event(data));
    at += 12 + len + 4;
  }
  return events;
}

}  // namespace

TEST(TensorBoard, Crc32cCheckValue) {
  EXPECT_EQ(crc32c("123456789"), 0xE3069283u);  // the standard CRC-32C check value
  EXPECT_EQ(crc32c("noloco"), slow_crc32c("noloco"));
  // The 8-byte (hardware or sliced) path against the bitwise one, at every alignment of the tail.
  std::string data(100003, '\0');
  for (size_t i = 0; i < data.size(); ++i) data[i] = char((i * 2654435761u) >> 13);
  for (size_t n : {size_t(1), size_t(7), size_t(8), size_t(9), size_t(4097), data.size()})
    EXPECT_EQ(crc32c(data.substr(0, n)), slow_crc32c(data.substr(0, n))) << n;
  EXPECT_EQ(crc32c_extend(crc32c(data.substr(0, 4097)), data.data() + 4097, data.size() - 4097), crc32c(data));
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
  const auto events = read_events(path);
  ASSERT_EQ(events.size(), 3u);
  EXPECT_EQ(events[0].file_version, "brain.Event:2");
  EXPECT_EQ(events[1].tag, "train/loss");
  EXPECT_EQ(events[1].step, 10);
  EXPECT_FLOAT_EQ(events[1].value, 2.5f);
  EXPECT_EQ(events[2].tag, "val/loss");
  EXPECT_EQ(events[2].step, 20);
  EXPECT_FLOAT_EQ(events[2].value, 1.75f);
}

// One record in, three outputs: the metrics.jsonl line, the TensorBoard
// scalars of the keys TensorBoard shows, and nothing for other splits.
TEST(Telemetry, OneRecordReachesMetricsAndTensorBoard) {
  noloco::testing::TempDir dir;
  {
    Telemetry t(dir.path(), 3, 100, /*console=*/false);
    t.write({{"step", 10}, {"split", "train"}, {"loss", 2.5}, {"lr", 1e-3}, {"bytes_sent", 4096}, {"grad_norm", 0.5}});
    t.write({{"step", 10}, {"split", "outer"}, {"outer_step", 0}, {"group", {0, 3}}});
    t.write({{"step", 20}, {"split", "val"}, {"loss", 1.75}, {"weight_std", 3e-4}});
  }
  const auto lines = noloco::testing::read_text(dir / "metrics.jsonl");
  EXPECT_EQ(std::count(lines.begin(), lines.end(), '\n'), 3);
  EXPECT_NE(lines.find(R"("split":"outer")"), std::string::npos);
  std::string path;
  for (auto& f : std::filesystem::directory_iterator(dir / "tensorboard/replica_3")) path = f.path().string();
  ASSERT_FALSE(path.empty());
  std::map<std::string, Scalar> by_tag;
  for (const auto& e : read_events(path))
    if (!e.tag.empty()) by_tag[e.tag] = e;
  ASSERT_EQ(by_tag.size(), 5u);  // grad_norm and the outer record have no tag
  EXPECT_FLOAT_EQ(by_tag["train/loss"].value, 2.5f);
  EXPECT_EQ(by_tag["train/loss"].step, 10);
  EXPECT_FLOAT_EQ(by_tag["comm/bytes_sent"].value, 4096.0f);
  EXPECT_FLOAT_EQ(by_tag["train/lr"].value, 1e-3f);
  EXPECT_FLOAT_EQ(by_tag["val/loss"].value, 1.75f);
  EXPECT_EQ(by_tag["val/weight_std_across_replicas"].step, 20);
}
