#include <gtest/gtest.h>

#include <algorithm>
#include <map>

#include <filesystem>

#include "test_util.h"
#include "train/telemetry.h"
#include "util/files.h"
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

// What TensorBoard's own reader finds in the event files of `dir` (each
// record's CRCs checked): file_versions, and scalars by tag as {step: value}.
struct EventsRead {
  std::vector<std::string> file_versions;
  std::map<std::string, std::map<int64_t, float>> scalars;
};
EventsRead read_events(const std::string& dir) {
  const auto out = dir + "/read.json";
  const auto r = noloco::testing::run_ecosystem("read_events " + dir + " --out " + out);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EventsRead read;
  if (r.exit_code != 0) return read;
  const auto j = read_json(out);
  std::filesystem::remove(out);
  read.file_versions = j["file_versions"].get<std::vector<std::string>>();
  for (const auto& [tag, points] : j["scalars"].items())
    for (const auto& p : points) read.scalars[tag][p[0].get<int64_t>()] = p[1].get<float>();
  return read;
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
  const auto events = read_events(dir / "tb");
  EXPECT_EQ(events.file_versions, std::vector<std::string>{"brain.Event:2"});
  ASSERT_EQ(events.scalars.size(), 2u);
  EXPECT_EQ(events.scalars.at("train/loss"), (std::map<int64_t, float>{{10, 2.5f}}));
  EXPECT_EQ(events.scalars.at("val/loss"), (std::map<int64_t, float>{{20, 1.75f}}));
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
  const auto events = read_events(dir / "tensorboard/replica_3");
  const auto& by_tag = events.scalars;
  ASSERT_EQ(by_tag.size(), 5u);  // grad_norm and the outer record have no tag
  EXPECT_EQ(by_tag.at("train/loss"), (std::map<int64_t, float>{{10, 2.5f}}));
  EXPECT_EQ(by_tag.at("comm/bytes_sent").at(10), 4096.0f);
  EXPECT_EQ(by_tag.at("train/lr").at(10), 1e-3f);
  EXPECT_EQ(by_tag.at("val/loss").at(20), 1.75f);
  EXPECT_EQ(by_tag.at("val/weight_std_across_replicas").count(20), 1u);
}
