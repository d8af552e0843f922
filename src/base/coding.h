// Little-endian fixed-width integers in byte buffers, as LevelDB's util/coding.h: encode writes
// at a pointer, put appends to a buffer, decode reads at a pointer; ByteReader reads fields off a
// span with every read checked against its end. Every wire format and file of cohort is
// little-endian (the store, gossip frames, codec messages, ps frames, checkpoints, TensorBoard
// records); the shifts compile to single loads and stores on a little-endian host.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

namespace cohort {

inline void encodeFixed16(uint8_t* dst, uint16_t v) {
  dst[0] = uint8_t(v);
  dst[1] = uint8_t(v >> 8);
}

inline void encodeFixed32(uint8_t* dst, uint32_t v) {
  dst[0] = uint8_t(v);
  dst[1] = uint8_t(v >> 8);
  dst[2] = uint8_t(v >> 16);
  dst[3] = uint8_t(v >> 24);
}

inline void encodeFixed64(uint8_t* dst, uint64_t v) {
  encodeFixed32(dst, uint32_t(v));
  encodeFixed32(dst + 4, uint32_t(v >> 32));
}

inline uint16_t decodeFixed16(const uint8_t* p) { return uint16_t(p[0] | p[1] << 8); }

inline uint32_t decodeFixed32(const uint8_t* p) {
  return uint32_t(p[0]) | uint32_t(p[1]) << 8 | uint32_t(p[2]) << 16 | uint32_t(p[3]) << 24;
}

inline uint64_t decodeFixed64(const uint8_t* p) { return decodeFixed32(p) | uint64_t(decodeFixed32(p + 4)) << 32; }

inline void putFixed16(std::vector<uint8_t>& dst, uint16_t v) {
  uint8_t buf[2];
  encodeFixed16(buf, v);
  dst.insert(dst.end(), buf, buf + 2);
}

inline void putFixed32(std::vector<uint8_t>& dst, uint32_t v) {
  uint8_t buf[4];
  encodeFixed32(buf, v);
  dst.insert(dst.end(), buf, buf + 4);
}

inline void putFixed64(std::vector<uint8_t>& dst, uint64_t v) {
  uint8_t buf[8];
  encodeFixed64(buf, v);
  dst.insert(dst.end(), buf, buf + 8);
}

// A float32 as its IEEE-754 bits.
inline void putFloat32(std::vector<uint8_t>& dst, float v) { putFixed32(dst, std::bit_cast<uint32_t>(v)); }

// Reads fields off a span of untrusted bytes. A read that does not fit reads nothing, returns
// zero (nullptr, an empty span) and leaves the reader failed for good, with nothing left to read:
// the caller checks ok() where its format wants and words its own error, so one reader serves the
// codec (which throws MalformedMessage), the gossip wire (InvalidArgument naming the frame) and the
// store's server (which drops the connection).
class ByteReader {
 public:
  ByteReader() = default;
  explicit ByteReader(std::span<const uint8_t> bytes)
      : begin_(bytes.data()), p_(bytes.data()), end_(bytes.data() + bytes.size()) {}
  ByteReader(const uint8_t* data, size_t size) : ByteReader(std::span<const uint8_t>(data, size)) {}

  // False once a read did not fit.
  bool ok() const { return ok_; }
  // Every read fitted and every byte was read.
  bool done() const { return ok_ && p_ == end_; }
  size_t left() const { return size_t(end_ - p_); }
  size_t consumed() const { return size_t(p_ - begin_); }
  const uint8_t* position() const { return p_; }

  // Marks the reader failed, for a field that fits but that the format refuses (a length beyond
  // its limit), so that one ok() check covers both.
  void fail() {
    ok_ = false;
    p_ = end_;
  }

  // The next n bytes; nullptr when fewer are left.
  const uint8_t* take(size_t n) {
    if (n > left()) {
      fail();
      return nullptr;
    }
    const uint8_t* at = p_;
    p_ += n;
    return at;
  }
  std::span<const uint8_t> bytes(size_t n) {
    const uint8_t* at = take(n);
    return at == nullptr ? std::span<const uint8_t>() : std::span<const uint8_t>(at, n);
  }
  std::span<const uint8_t> rest() { return bytes(left()); }
  // Fills out with the next out.size() bytes (zeros when they do not fit).
  void copyTo(std::span<uint8_t> out) {
    const uint8_t* at = take(out.size());
    for (size_t i = 0; i < out.size(); ++i) out[i] = at == nullptr ? 0 : at[i];
  }

  uint8_t u8() {
    const uint8_t* at = take(1);
    return at == nullptr ? 0 : *at;
  }
  uint16_t u16() {
    const uint8_t* at = take(2);
    return at == nullptr ? 0 : decodeFixed16(at);
  }
  uint32_t u32() {
    const uint8_t* at = take(4);
    return at == nullptr ? 0 : decodeFixed32(at);
  }
  uint64_t u64() {
    const uint8_t* at = take(8);
    return at == nullptr ? 0 : decodeFixed64(at);
  }
  float f32() { return std::bit_cast<float>(u32()); }

 private:
  const uint8_t* begin_ = nullptr;
  const uint8_t* p_ = nullptr;
  const uint8_t* end_ = nullptr;
  bool ok_ = true;
};

}  // namespace cohort
