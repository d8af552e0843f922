// What the encoder (encoder.cpp) and the decoder (codec.cpp) agree on: the message header's
// constants. The layout is in docs/ARCHITECTURE.md ("Message format"). Internal to src/compress.
#pragma once

#include "compress/codec.h"

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>

namespace cohort::compress {

// The encoder writes and the decoder reads the little-endian layout (bitmap words, floats, 16-bit
// values) with the host's byte order.
static_assert(std::endian::native == std::endian::little, "the codec messages assume a little-endian host");

inline constexpr uint8_t kMagic[4] = {'C', 'O', 'C', 'M'};
inline constexpr uint8_t kVersion = 1;

inline size_t bitmapBytes(uint64_t bits) { return size_t((bits + 7) / 8); }
inline bool bitAt(const uint8_t* bitmap, size_t i) { return (bitmap[i / 8] >> (i % 8)) & 1; }

// How a topk or threshold message lays out its entries (the header's byte 6). Every other codec
// uses kFormList (0), which for them means "the body is one zstd frame".
//   kFormList:   the body is a zstd frame of: u32 n | n varints (the first index, then the
//                differences) | value-entry bitmap (n bits) | sign bitmap (n bits) | floats.
//   kFormBitmap: the body, raw (no zstd): u32 n | u32 v (value entries) | sent bitmap (length
//                bits, n set) | the value entries' ordinals among the n entries (v u32, strictly
//                increasing, only when 0 < v < n) | sign bitmap (n - v bits, one per sign entry)
//                | v floats.
// The encoder picks the smaller by its estimate (encoder_forms.cpp, bitmapFormPays), per message.
inline constexpr uint8_t kFormList = 0;
inline constexpr uint8_t kFormBitmap = 1;

// The bytes of a bitmap-form body of n entries, v of them value entries, for `length` floats.
inline uint64_t bitmapFormBytes(uint64_t length, uint64_t n, uint64_t v) {
  return 8 + bitmapBytes(length) + (v > 0 && v < n ? 4 * v : 0) + bitmapBytes(n - v) + 4 * v;
}

// A list-form body's parts, in place. forEach only on a body that was checked (or written here).
struct ListView {
  uint32_t count = 0;
  const uint8_t* varints = nullptr;
  const uint8_t* isValue = nullptr;   // bitmap
  const uint8_t* negative = nullptr;  // bitmap
  const uint8_t* values = nullptr;    // one little-endian f32 per value entry, in index order

  // f(index, isValue, negative, value bits) for each entry, in index order.
  template <typename F>
  void forEach(F&& f) const {
    const uint8_t* p = varints;
    const uint8_t* value = values;
    uint32_t index = 0;
    for (uint32_t i = 0; i < count; ++i) {
      uint32_t delta = 0;
      for (int shift = 0;; shift += 7) {
        const uint8_t b = *p++;
        delta |= uint32_t(b & 0x7f) << shift;
        if (!(b & 0x80)) break;
      }
      index += delta;  // the first varint is the index itself
      const bool isValueEntry = bitAt(isValue, i);
      uint32_t bits = 0;
      if (isValueEntry) {
        std::memcpy(&bits, value, 4);
        value += 4;
      }
      f(index, isValueEntry, bitAt(negative, i), bits);
    }
  }
};

// A bitmap-form body's parts, in place; the same contract.
struct BitmapView {
  uint64_t length = 0;
  uint32_t count = 0;
  uint32_t valueCount = 0;
  const uint8_t* sent = nullptr;      // length bits
  const uint8_t* ordinals = nullptr;  // valueCount u32; null when valueCount is 0 or count
  const uint8_t* negative = nullptr;  // count - valueCount bits, one per sign entry
  const uint8_t* values = nullptr;

  // The 64 bits of the sent bitmap from entry 64 w on (zero past the end).
  uint64_t sentWord(size_t w) const {
    const size_t bytes = bitmapBytes(length);
    uint64_t word = 0;
    std::memcpy(&word, sent + 8 * w, 8 * w + 8 <= bytes ? 8 : bytes - 8 * w);
    return word;
  }

  template <typename F>
  void forEach(F&& f) const {
    const uint8_t* value = values;
    size_t entry = 0, sign = 0, ordinal = 0;
    // The ordinal of the next value entry (count when there is none left).
    auto nextValue = [&] {
      if (ordinal >= valueCount) return size_t(count);
      uint32_t at;
      std::memcpy(&at, ordinals + 4 * ordinal, 4);
      return size_t(at);
    };
    size_t next = ordinals == nullptr ? count : nextValue();
    for (size_t w = 0; 64 * w < length; ++w) {
      for (uint64_t m = sentWord(w); m != 0; m &= m - 1) {
        const uint32_t index = uint32_t(64 * w + size_t(std::countr_zero(m)));
        bool isValueEntry = valueCount == count;
        if (entry == next) {
          isValueEntry = true;
          ++ordinal;
          next = nextValue();
        }
        ++entry;
        uint32_t bits = 0;
        bool negativeEntry = false;
        if (isValueEntry) {
          std::memcpy(&bits, value, 4);
          value += 4;
        } else {
          negativeEntry = bitAt(negative, sign++);
        }
        f(index, isValueEntry, negativeEntry, bits);
      }
    }
  }
};

// "none", "fp16", ...: the name --codec uses.
const char* kindName(CodecKind kind);

}  // namespace cohort::compress
