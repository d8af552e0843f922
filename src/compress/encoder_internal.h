// Inside the encoders (compress/codec.h's Encoder): the writers of a sparse list's two forms
// (compress/format.h) and each error-feedback codec's pass over input and residual. They live in
//   encoder.cpp            Encoder: the dense codecs, which form a list goes in, header and zstd
//   encoder_forms.cpp      whether the bitmap form pays, and rewriting one form into the other
//   encoder_threshold.cpp  threshold's pass (and its AVX2 kernel)
//   encoder_topk.cpp       topk's pass: the exact selection, and the Fast path's sampled one
//   encoder_onebit.cpp     onebit's pass: the two scales and the sign bitmap
// docs/ARCHITECTURE.md ("Compression") explains the layouts and the residual arithmetic.
#pragma once

#include "base/coding.h"
#include "compress/format.h"

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <span>
#include <vector>

namespace cohort::compress {

// A sparse list: strictly increasing indices, each either a "sign entry" (decoded as +-magnitude,
// the codec's parameter) or a "value entry" (an explicit float). Laid out as
//   u32 n | n varints: the first index, then the difference to the previous one (>= 1)
//   | value-entry bitmap | sign bitmap | the value entries' floats, in index order.
// Entries are added in index order through a Cursor: the varints go straight into the body, the
// bitmaps' bits gather in 64-bit words, and finish() appends bitmaps and floats.
class ListWriter {
 public:
  // Where the list stands. The encoding loops hold it by value, so that the compiler keeps it in
  // registers: a varint's byte store through a member pointer could alias any member.
  struct Cursor {
    uint8_t* next = nullptr;  // where the next varint goes
    uint8_t* end = nullptr;   // the end of the room reserved in the body
    uint32_t previous = 0;    // the last index added (0 before the first: its varint is the index)
    uint32_t count = 0;
    uint64_t valueBits = 0;  // the bitmaps' words for the entries since the last multiple of 64
    uint64_t negativeBits = 0;
  };

  // Starts a list at the end of body, which must outlive the list.
  Cursor begin(std::vector<uint8_t>& body) {
    body_ = &body;
    countAt_ = body.size();
    valueWords_.clear();
    negativeWords_.clear();
    values_.clear();
    body.resize(countAt_ + 4);
    Cursor c;
    c.next = c.end = body.data() + body.size();
    return c;
  }
  // Room for the varints of `entries` more entries (at most 5 bytes each).
  Cursor reserve(Cursor c, size_t entries) {
    if (size_t(c.end - c.next) < 5 * entries) [[unlikely]] {
      const Room room = grow(c.next, 5 * entries);
      c.next = room.next;
      c.end = room.end;
    }
    return c;
  }
  void addSign(Cursor& c, size_t index, bool negative) {
    putVarint(c, index);
    c.negativeBits |= uint64_t(negative) << (c.count % 64);
    advance(c);
  }
  void addValue(Cursor& c, size_t index, float value) {
    putVarint(c, index);
    c.valueBits |= uint64_t(1) << (c.count % 64);
    values_.push_back(value);
    advance(c);
  }
  // Value entries added so far.
  size_t values() const { return values_.size(); }
  void finish(Cursor c) {
    if (c.count % 64 != 0) {
      valueWords_.push_back(c.valueBits);
      negativeWords_.push_back(c.negativeBits);
    }
    std::vector<uint8_t>& body = *body_;
    body.resize(size_t(c.next - body.data()));
    encodeFixed32(body.data() + countAt_, c.count);
    // Little-endian words: entry j's bit is bit j % 8 of byte j / 8, as in the layout.
    const size_t bitmap = bitmapBytes(c.count);
    for (const auto* words : {&valueWords_, &negativeWords_}) {
      const auto* bytes = reinterpret_cast<const uint8_t*>(words->data());
      body.insert(body.end(), bytes, bytes + bitmap);
    }
    const size_t floatsAt = body.size();
    body.resize(floatsAt + 4 * values_.size());
    if (!values_.empty()) std::memcpy(body.data() + floatsAt, values_.data(), 4 * values_.size());
  }

 private:
  static void putVarint(Cursor& c, size_t index) {
    uint32_t v = uint32_t(index) - c.previous;
    c.previous = uint32_t(index);
    while (v >= 0x80) {
      *c.next++ = uint8_t(v | 0x80);
      v >>= 7;
    }
    *c.next++ = uint8_t(v);
  }
  void advance(Cursor& c) {
    if (++c.count % 64 == 0) {
      valueWords_.push_back(c.valueBits);
      negativeWords_.push_back(c.negativeBits);
      c.valueBits = c.negativeBits = 0;
    }
  }
  struct Room {
    uint8_t* next;
    uint8_t* end;
  };
  // Two pointers come back in registers, where a whole Cursor would go through memory.
  [[gnu::noinline]] Room grow(uint8_t* next, size_t bytes) {
    std::vector<uint8_t>& body = *body_;
    const size_t used = size_t(next - body.data());
    body.resize(std::max(2 * body.size(), used + bytes + 4096));
    return {body.data() + used, body.data() + body.size()};
  }

  std::vector<uint8_t>* body_ = nullptr;
  size_t countAt_ = 0;  // where the u32 n goes
  std::vector<uint64_t> valueWords_;
  std::vector<uint64_t> negativeWords_;
  std::vector<float> values_;
};
using Cursor = ListWriter::Cursor;

// The bitmap form of the same entries (format.h): a sent bitmap of `length` bits written in place,
// the sign entries' bits packed in 64-bit words, the value entries' ordinals and floats kept aside;
// finish() lays them out. Entries arrive in index order; the hot loops hold the Cursor by value.
class BitmapWriter {
 public:
  struct Cursor {
    uint64_t signBits = 0;  // sign bits since the last full word
    uint32_t signUsed = 0;
    uint32_t count = 0;  // entries so far
  };

  Cursor begin(std::vector<uint8_t>& body, size_t length) {
    body_ = &body;
    body.assign(8 + bitmapBytes(length), 0);
    signWords_.clear();
    valueOrdinals_.clear();
    values_.clear();
    return {};
  }
  // The sent bitmap (length bits, zero at first).
  uint8_t* sent() const { return body_->data() + 8; }

  // `count` (<= 8) sign entries whose sent bits the caller set, negative where `negatives` (packed)
  // has a bit.
  void addSigns(Cursor& c, unsigned count, uint64_t negatives) {
    c.signBits |= negatives << c.signUsed;
    c.signUsed += count;
    c.count += count;
    if (c.signUsed >= 64) {
      signWords_.push_back(c.signBits);
      c.signUsed -= 64;
      c.signBits = c.signUsed == 0 ? 0 : negatives >> (count - c.signUsed);
    }
  }
  // A value entry whose sent bit the caller set.
  void addValueEntry(Cursor& c, float value) {
    valueOrdinals_.push_back(c.count++);
    values_.push_back(value);
  }
  void addSign(Cursor& c, size_t index, bool negative) {
    sent()[index / 8] |= uint8_t(1u << (index % 8));
    addSigns(c, 1, uint64_t(negative));
  }
  void addValue(Cursor& c, size_t index, float value) {
    sent()[index / 8] |= uint8_t(1u << (index % 8));
    addValueEntry(c, value);
  }
  size_t values() const { return values_.size(); }

  void finish(Cursor c) {
    std::vector<uint8_t>& body = *body_;
    const uint32_t n = c.count;
    const uint32_t v = uint32_t(values_.size());
    encodeFixed32(body.data(), n);
    encodeFixed32(body.data() + 4, v);
    if (v > 0 && v < n) {
      const size_t at = body.size();
      body.resize(at + 4 * size_t(v));
      std::memcpy(body.data() + at, valueOrdinals_.data(), 4 * size_t(v));
    }
    if (c.signUsed > 0) signWords_.push_back(c.signBits);
    const auto* signs = reinterpret_cast<const uint8_t*>(signWords_.data());
    body.insert(body.end(), signs, signs + bitmapBytes(n - v));
    const size_t floatsAt = body.size();
    body.resize(floatsAt + 4 * size_t(v));
    if (v > 0) std::memcpy(body.data() + floatsAt, values_.data(), 4 * size_t(v));
  }

 private:
  std::vector<uint8_t>* body_ = nullptr;
  std::vector<uint64_t> signWords_;
  std::vector<uint32_t> valueOrdinals_;
  std::vector<float> values_;
};

// What a sparse codec's pass (topk, threshold) wrote into the body.
struct SparsePass {
  size_t count = 0;          // entries
  size_t values = 0;         // of them value entries
  bool wroteBitmap = false;  // in the bitmap form (else the list form)
};

// acc[i] = residual[i] + input[i], in place.
void accumulate(std::span<const float> input, float* residual);

// What threshold sends for an entry whose acc a has !(|a| < tau) (|a| >= tau, or NaN): a sign entry
// (+-tau) or a value entry, and the residual it keeps (encoder_threshold.cpp says why).
struct ThresholdEntry {
  bool isValue;
  float value;
  float residual;
};
inline ThresholdEntry thresholdEntry(float a, float tau) {
  if (std::isnan(a)) return {true, a, 0.0f};
  const float r = a < 0.0f ? a + tau : a - tau;
  if (std::fabs(a) < tau * 65536.0f) return {false, 0.0f, r};
  if (std::isfinite(a) && r != a) return {true, a - r, r};
  return {true, a, 0.0f};
}

// encoder_forms.cpp
// Whether the bitmap form of n entries (v of them value entries) out of `length` is worth sending
// instead of the zstd'd list. The list's size is estimated as what zstd reaches on it: the entropy
// of the sent set, length * H(n / length) bits (the index gaps carry no more), plus the sign bits
// and the floats (measured: within 15 % on the cnn's threshold messages). The bitmap form is never
// smaller than that (H <= 1), but it takes neither zstd nor varints to write and read: it is chosen
// while it stays within 25 % of the estimate: threshold from about 22 % of the entries sent on,
// topk (whose floats weigh the same in both forms) from about 7 %.
bool bitmapFormPays(uint64_t length, uint64_t n, uint64_t v);
// Rewrites `from` (the form the encoding pass wrote) in the other form, into `to`.
void listToBitmap(const std::vector<uint8_t>& from, size_t length, BitmapWriter& writer, std::vector<uint8_t>& to);
void bitmapToList(const std::vector<uint8_t>& from, size_t length, ListWriter& list, std::vector<uint8_t>& to);

// The passes. Each starts the body (empty), leaves acc - sent in the residual, and, fused (the
// Fast path), forms acc = residual + input on the way; else acc is already in the residual.

// encoder_threshold.cpp: every entry with |acc| >= tau.
SparsePass encodeThresholdPass(std::span<const float> input, float* acc, float tau, bool fused, ListWriter& list,
                               BitmapWriter& bitmap, std::vector<uint8_t>& body);

// encoder_topk.cpp
struct TopKScratch {
  std::vector<float> magnitudes;
  std::vector<uint32_t> candidates;  // indices, increasing
  uint64_t random = 0x9e3779b97f4a7c15u;

  // splitmix64 (Steele et al. 2014): the sample's positions, which change the work, not the result.
  uint64_t next() {
    uint64_t z = (random += 0x9e3779b97f4a7c15u);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9u;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebu;
    return z ^ (z >> 31);
  }
};

// The k = ceil(ratio * finite) largest finite |acc|, and every non-finite entry.
SparsePass encodeTopKPass(std::span<const float> input, float* acc, double ratio, bool fused, TopKScratch& scratch,
                          ListWriter& list, std::vector<uint8_t>& body);

// encoder_onebit.cpp: the two scales, the sign bitmap, and the non-finite entries as a list.
void encodeOneBitPass(std::span<const float> input, float* acc, bool fused, ListWriter& list,
                      std::vector<uint8_t>& body);

}  // namespace cohort::compress
