// base/coding.h: the byte order of the fixed-width fields and ByteReader's checked reads.
#include "base/coding.h"

#include <gtest/gtest.h>

#include <array>
#include <cstdint>
#include <limits>
#include <vector>

namespace cohort {
namespace {

TEST(Coding, FixedWidthFieldsAreLittleEndian) {
  std::vector<uint8_t> out;
  putFixed16(out, 0x0102);
  putFixed32(out, 0x03040506);
  putFixed64(out, 0x0708090a0b0c0d0eull);
  putFloat32(out, 1.0f);  // 0x3f800000
  const std::vector<uint8_t> expected = {0x02, 0x01, 0x06, 0x05, 0x04, 0x03, 0x0e, 0x0d, 0x0c,
                                         0x0b, 0x0a, 0x09, 0x08, 0x07, 0x00, 0x00, 0x80, 0x3f};
  EXPECT_EQ(out, expected);
  EXPECT_EQ(decodeFixed16(out.data()), 0x0102);
  EXPECT_EQ(decodeFixed32(out.data() + 2), 0x03040506u);
  EXPECT_EQ(decodeFixed64(out.data() + 6), 0x0708090a0b0c0d0eull);
}

TEST(Coding, EncodeAndDecodeRoundTripTheExtremes) {
  uint8_t buf[8];
  for (uint64_t v : {uint64_t(0), uint64_t(1), uint64_t(0x80), uint64_t(0xffffffff), uint64_t(1) << 63,
                     std::numeric_limits<uint64_t>::max()}) {
    encodeFixed64(buf, v);
    EXPECT_EQ(decodeFixed64(buf), v);
    encodeFixed32(buf, uint32_t(v));
    EXPECT_EQ(decodeFixed32(buf), uint32_t(v));
    encodeFixed16(buf, uint16_t(v));
    EXPECT_EQ(decodeFixed16(buf), uint16_t(v));
  }
}

TEST(ByteReader, ReadsFieldsInOrder) {
  std::vector<uint8_t> bytes = {7};
  putFixed16(bytes, 0xbeef);
  putFixed32(bytes, 0xdeadbeef);
  putFixed64(bytes, 0x0123456789abcdefull);
  putFloat32(bytes, -2.5f);
  bytes.insert(bytes.end(), {1, 2, 3});
  ByteReader r(bytes);
  EXPECT_EQ(r.u8(), 7);
  EXPECT_EQ(r.u16(), 0xbeef);
  EXPECT_EQ(r.u32(), 0xdeadbeefu);
  EXPECT_EQ(r.u64(), 0x0123456789abcdefull);
  EXPECT_EQ(r.f32(), -2.5f);
  EXPECT_EQ(r.consumed(), 19u);
  EXPECT_EQ(r.left(), 3u);
  EXPECT_FALSE(r.done());
  const std::span<const uint8_t> rest = r.rest();
  EXPECT_EQ(std::vector<uint8_t>(rest.begin(), rest.end()), (std::vector<uint8_t>{1, 2, 3}));
  EXPECT_TRUE(r.ok());
  EXPECT_TRUE(r.done());
}

TEST(ByteReader, AReadPastTheEndFailsForGood) {
  const std::vector<uint8_t> bytes = {1, 2, 3};
  ByteReader r(bytes);
  EXPECT_EQ(r.u16(), 0x0201);
  EXPECT_EQ(r.u32(), 0u);  // 1 byte left: reads nothing
  EXPECT_FALSE(r.ok());
  EXPECT_FALSE(r.done());
  EXPECT_EQ(r.left(), 0u);
  EXPECT_EQ(r.u8(), 0);  // the byte that was left is not read after the failure either
  EXPECT_EQ(r.take(0), r.position());
  EXPECT_FALSE(r.ok());
}

TEST(ByteReader, TakeChecksTheLengthWithoutOverflow) {
  const std::vector<uint8_t> bytes(16, 0xab);
  ByteReader r(bytes);
  EXPECT_EQ(r.take(4), bytes.data());
  EXPECT_EQ(r.take(std::numeric_limits<size_t>::max()), nullptr);  // a hostile length
  EXPECT_FALSE(r.ok());
  EXPECT_TRUE(r.bytes(1).empty());
}

TEST(ByteReader, CopyToFillsZerosWhenShort) {
  const std::vector<uint8_t> bytes = {9, 8, 7};
  std::array<uint8_t, 4> out{1, 1, 1, 1};
  ByteReader r(bytes);
  r.copyTo(out);
  EXPECT_EQ(out, (std::array<uint8_t, 4>{0, 0, 0, 0}));
  EXPECT_FALSE(r.ok());

  std::array<uint8_t, 2> two{};
  ByteReader s(bytes);
  s.copyTo(two);
  EXPECT_EQ(two, (std::array<uint8_t, 2>{9, 8}));
  EXPECT_TRUE(s.ok());
}

TEST(ByteReader, FailRefusesAFieldThatFits) {
  const std::vector<uint8_t> bytes = {1, 2, 3, 4};
  ByteReader r(bytes);
  r.u8();
  r.fail();
  EXPECT_FALSE(r.ok());
  EXPECT_EQ(r.left(), 0u);
  EXPECT_EQ(r.u8(), 0);
}

TEST(ByteReader, AnEmptySpanHasNothingToRead) {
  ByteReader r(std::span<const uint8_t>{});
  EXPECT_TRUE(r.done());
  EXPECT_EQ(r.u8(), 0);
  EXPECT_FALSE(r.ok());
}

}  // namespace
}  // namespace cohort
