#include <gtest/gtest.h>

#include <cstring>

#include "util/safetensors.h"

using namespace noloco;

namespace {

std::string sample_file() {
  SafetensorsWriter w;
  const float a[6] = {1, 2, 3, 4, 5, 6};
  const int64_t b[2] = {-7, 1LL << 40};
  w.add("a", "F32", {2, 3}, a, sizeof a);
  w.add("b", "I64", {2}, b, sizeof b);
  w.set_metadata("format", "pt");
  return w.serialize();
}

void set_header_length(std::string& f, uint64_t n) {
  for (int i = 0; i < 8; ++i) f[size_t(i)] = char((n >> (8 * i)) & 0xff);
}

std::string expect_error(std::string bytes) {
  try {
    parse_safetensors(std::move(bytes));
  } catch (const std::runtime_error& e) {
    return e.what();
  }
  ADD_FAILURE() << "malformed file accepted";
  return "";
}

}  // namespace

TEST(Safetensors, RoundTrip) {
  auto f = parse_safetensors(sample_file());
  ASSERT_EQ(f.tensors.size(), 2u);
  EXPECT_EQ(f.metadata.at("format"), "pt");
  const auto& a = f.tensors.at("a");
  EXPECT_EQ(a.dtype, "F32");
  EXPECT_EQ(a.shape, (std::vector<int64_t>{2, 3}));
  float values[6];
  std::memcpy(values, a.data.data(), sizeof values);
  EXPECT_EQ(values[5], 6.0f);
  int64_t b[2];
  std::memcpy(b, f.tensors.at("b").data.data(), sizeof b);
  EXPECT_EQ(b[1], 1LL << 40);
}

TEST(Safetensors, HeaderIsLittleEndianLengthThenJsonThenAlignedData) {
  const auto bytes = sample_file();
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | uint8_t(bytes[size_t(i)]);
  EXPECT_EQ(bytes[8], '{');
  EXPECT_EQ((8 + n) % 8, 0u);
  EXPECT_EQ(bytes.size(), 8 + n + 6 * 4 + 2 * 8);
}

TEST(Safetensors, RejectsTruncatedFile) {
  auto bytes = sample_file();
  EXPECT_NE(expect_error(bytes.substr(0, 5)).find("shorter than"), std::string::npos);
  EXPECT_NE(expect_error(bytes.substr(0, bytes.size() - 4)).find("outside"), std::string::npos);
}

TEST(Safetensors, RejectsHeaderLengthBeyondFile) {
  auto bytes = sample_file();
  set_header_length(bytes, 1u << 30);
  EXPECT_NE(expect_error(bytes).find("exceeds"), std::string::npos);
}

TEST(Safetensors, RejectsSizeMismatchUnknownDtypeAndOverlap) {
  auto make = [](const std::string& json, size_t data) {
    std::string f(8, '\0');
    set_header_length(f, json.size());
    return f + json + std::string(data, '\0');
  };
  EXPECT_NE(expect_error(make(R"({"x":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 8)).find("bytes for 3"),
            std::string::npos);
  EXPECT_NE(expect_error(make(R"({"x":{"dtype":"Q7","shape":[1],"data_offsets":[0,1]}})", 1)).find("unknown dtype"),
            std::string::npos);
  EXPECT_NE(expect_error(make(R"({"x":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},)"
                              R"("y":{"dtype":"U8","shape":[4],"data_offsets":[2,6]}})", 6))
                .find("overlap"),
            std::string::npos);
  EXPECT_NE(expect_error(make(R"({"x":{"dtype":"U8","shape":[-1],"data_offsets":[0,1]}})", 1)).find("dimension"),
            std::string::npos);
  EXPECT_NE(expect_error(make("[1,2]", 0)).find("not a JSON object"), std::string::npos);
}
