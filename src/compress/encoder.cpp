// The encoders: each keeps its buffer's error-feedback residual and writes messages in the layout
// of docs/ARCHITECTURE.md ("Compression"), which also explains the residual arithmetic.
#include "compress/codec.h"

#include "base/coding.h"
#include "compress/convert.h"
#include "compress/format.h"
#include "compress/path.h"

#include <zstd.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <optional>

namespace cohort::compress {

namespace {

constexpr int kZstdLevel = 1;

void putHeader(std::vector<uint8_t>& out, CodecKind kind, uint64_t length, float param, uint32_t bodyBytes,
               uint8_t form = kFormList) {
  out.insert(out.end(), kMagic, kMagic + 4);
  out.push_back(kVersion);
  out.push_back(uint8_t(kind));
  out.push_back(form);
  out.push_back(0);
  putFixed64(out, length);
  putFloat32(out, param);
  putFixed32(out, bodyBytes);
}

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

// kCompact4[mask][bits]: the bits of the 4-bit `bits` selected by `mask`, side by side from bit 0.
constexpr auto kCompact4 = [] {
  std::array<std::array<uint8_t, 16>, 16> table{};
  for (unsigned mask = 0; mask < 16; ++mask) {
    for (unsigned bits = 0; bits < 16; ++bits) {
      unsigned out = 0, at = 0;
      for (unsigned j = 0; j < 4; ++j) {
        if ((mask >> j) & 1) out |= ((bits >> j) & 1) << at++;
      }
      table[mask][bits] = uint8_t(out);
    }
  }
  return table;
}();

// The bits of the 8-bit `bits` selected by `mask`, side by side from bit 0 (BMI2's pext, which is
// slow on some CPUs this library runs on).
inline uint64_t compactBits(unsigned bits, unsigned mask) {
  const unsigned low = kCompact4[mask & 15][bits & 15];
  const unsigned high = kCompact4[(mask >> 4) & 15][(bits >> 4) & 15];
  return uint64_t(low | high << std::popcount(mask & 15));
}

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

// Whether the bitmap form of n entries (v of them value entries) out of `length` is worth sending
// instead of the zstd'd list. The list's size is estimated as what zstd reaches on it: the entropy
// of the sent set, length * H(n / length) bits (the index gaps carry no more), plus the sign bits
// and the floats (measured: within 15 % on the cnn's threshold messages). The bitmap form is never
// smaller than that (H <= 1), but it takes neither zstd nor varints to write and read: it is chosen
// while it stays within 25 % of the estimate: threshold from about 22 % of the entries sent on,
// topk (whose floats weigh the same in both forms) from about 7 %.
bool bitmapFormPays(uint64_t length, uint64_t n, uint64_t v) {
  if (n == 0) return false;
  const double p = double(n) / double(length);
  const double entropy = p >= 1.0 ? 0.0 : -p * std::log2(p) - (1.0 - p) * std::log2(1.0 - p);
  const double listBits = double(length) * entropy + double(n - v) + 32.0 * double(v);
  return 8.0 * double(bitmapFormBytes(length, n, v)) <= 1.25 * listBits;
}

// acc[i] = residual[i] + input[i], in place.
void accumulate(std::span<const float> input, float* residual) {
  for (size_t i = 0; i < input.size(); ++i) residual[i] += input[i];
}

// ---- threshold -----------------------------------------------------------------------------------
//
// tau has at most 8 significant bits, tau = m * 2^q with m < 2^8, so for tau <= |acc| < 2^16 tau
// both acc and tau are multiples of ulp(acc) and acc -+ tau (smaller than |acc|) is exact: a sign
// entry. Beyond that, r = fl(acc -+ tau) lies within a factor 2 of acc, so acc - r is exact
// (Sterbenz) and is sent as a value entry: +-tau up to acc's rounding, so that the step stays as
// small as Strom's however large the residual has grown. Only when tau is below half an ulp of acc
// (|acc| > 2^24 tau, r == acc) is acc sent whole; non-finite acc too.

// What threshold sends for an entry whose acc a has !(|a| < tau) (|a| >= tau, or NaN): a sign entry
// (+-tau) or a value entry, and the residual it keeps.
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
// One entry with |a| >= tau into either form's writer (both take addValue / addSign by index).
template <typename Writer>
inline void addThresholdEntry(Writer& list, typename Writer::Cursor& c, size_t i, float a, float tau, float* residual) {
  const ThresholdEntry e = thresholdEntry(a, tau);
  if (e.isValue) {
    list.addValue(c, i, e.value);
  } else {
    list.addSign(c, i, a < 0.0f);
  }
  residual[i] = e.residual;
}

// The reference: acc is already in place.
void encodeThreshold(float* acc, size_t n, float tau, ListWriter& list, Cursor& c) {
  for (size_t i = 0; i < n; ++i) {
    if (std::fabs(acc[i]) < tau) continue;
    c = list.reserve(c, 1);
    addThresholdEntry(list, c, i, acc[i], tau, acc);
  }
}

// The same in one pass that also forms acc = residual + input, from entry `from` on.
void encodeThresholdFused(std::span<const float> input, float* residual, float tau, ListWriter& list, Cursor& c,
                          size_t from = 0) {
  for (size_t i = from; i < input.size(); ++i) {
    const float a = residual[i] + input[i];
    residual[i] = a;
    if (std::fabs(a) < tau) continue;
    c = list.reserve(c, 1);
    addThresholdEntry(list, c, i, a, tau, residual);
  }
}

#if defined(COHORT_HAVE_AVX2_KERNELS)
// encodeThresholdFused, 8 entries at a time, writing the bitmap form: the sums, the test against
// tau and the sign entries' residuals in vector lanes, so that the branches are per 8 entries (a
// fraction of the entries passes tau at random: a branch per entry would be mispredicted at that
// rate); a block's sent byte goes straight into the sent bitmap and its sign entries' bits are
// packed onto the sign words. Entries beyond 2^16 tau and NaN go through thresholdEntry.
COHORT_AVX2 void encodeThresholdBitmapAvx2(std::span<const float> input, float* residual, float tau,
                                           BitmapWriter& writer, BitmapWriter::Cursor& cursor) {
  BitmapWriter::Cursor c = cursor;
  uint8_t* sent = writer.sent();
  const __m256 tauV = _mm256_set1_ps(tau);
  const __m256 limit = _mm256_set1_ps(tau * 65536.0f);
  const __m256 absMask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  size_t i = 0;
  for (; i + 8 <= input.size(); i += 8) {
    const __m256 a = _mm256_add_ps(_mm256_loadu_ps(residual + i), _mm256_loadu_ps(input.data() + i));
    const __m256 m = _mm256_and_ps(a, absMask);
    const __m256 passes = _mm256_cmp_ps(m, tauV, _CMP_NLT_UQ);  // !(|a| < tau): NaN too
    const unsigned send = unsigned(_mm256_movemask_ps(passes));
    if (send == 0) {
      _mm256_storeu_ps(residual + i, a);
      continue;
    }
    sent[i / 8] = uint8_t(send);
    const __m256 negative = _mm256_cmp_ps(a, _mm256_setzero_ps(), _CMP_LT_OQ);
    const __m256 r = _mm256_blendv_ps(_mm256_sub_ps(a, tauV), _mm256_add_ps(a, tauV), negative);
    const __m256 signEntry = _mm256_and_ps(passes, _mm256_cmp_ps(m, limit, _CMP_LT_OQ));
    _mm256_storeu_ps(residual + i, _mm256_blendv_ps(a, r, signEntry));
    const unsigned signs = unsigned(_mm256_movemask_ps(signEntry));
    const unsigned negatives = unsigned(_mm256_movemask_ps(negative));
    if (send == signs) {
      writer.addSigns(c, unsigned(__builtin_popcount(signs)), compactBits(negatives, signs));
      continue;
    }
    for (unsigned bits = send; bits != 0; bits &= bits - 1) {
      const unsigned j = unsigned(__builtin_ctz(bits));
      if ((signs >> j) & 1) {
        writer.addSigns(c, 1, (negatives >> j) & 1);
      } else {
        const ThresholdEntry e = thresholdEntry(residual[i + j], tau);
        if (e.isValue) {
          writer.addValueEntry(c, e.value);
        } else {
          writer.addSigns(c, 1, residual[i + j] < 0.0f);
        }
        residual[i + j] = e.residual;
      }
    }
  }
  for (; i < input.size(); ++i) {
    const float a = residual[i] + input[i];
    residual[i] = a;
    if (std::fabs(a) < tau) continue;
    addThresholdEntry(writer, c, i, a, tau, residual);
  }
  cursor = c;
}
#endif

// ---- the two forms of a list ----------------------------------------------------------------------

// The parts of a list-form body this file wrote.
ListView viewList(const std::vector<uint8_t>& body) {
  ListView view;
  std::memcpy(&view.count, body.data(), 4);
  view.varints = body.data() + 4;
  const uint8_t* p = view.varints;
  for (uint32_t i = 0; i < view.count; ++i) {
    while (*p++ & 0x80) {
    }
  }
  view.isValue = p;
  view.negative = p + bitmapBytes(view.count);
  view.values = view.negative + bitmapBytes(view.count);
  return view;
}

// The parts of a bitmap-form body this file wrote.
BitmapView viewBitmap(const std::vector<uint8_t>& body, size_t length) {
  BitmapView view;
  view.length = length;
  std::memcpy(&view.count, body.data(), 4);
  std::memcpy(&view.valueCount, body.data() + 4, 4);
  view.sent = body.data() + 8;
  const uint8_t* p = view.sent + bitmapBytes(length);
  if (view.valueCount > 0 && view.valueCount < view.count) {
    view.ordinals = p;
    p += 4 * size_t(view.valueCount);
  }
  view.negative = p;
  view.values = p + bitmapBytes(view.count - view.valueCount);
  return view;
}

// Rewrites `from` (the form the encoding pass wrote) in the other form, into `to`.
void listToBitmap(const std::vector<uint8_t>& from, size_t length, BitmapWriter& writer, std::vector<uint8_t>& to) {
  BitmapWriter::Cursor c = writer.begin(to, length);
  viewList(from).forEach([&](uint32_t index, bool isValue, bool negative, uint32_t bits) {
    if (isValue) {
      writer.addValue(c, index, std::bit_cast<float>(bits));
    } else {
      writer.addSign(c, index, negative);
    }
  });
  writer.finish(c);
}
void bitmapToList(const std::vector<uint8_t>& from, size_t length, ListWriter& list, std::vector<uint8_t>& to) {
  to.clear();
  Cursor c = list.begin(to);
  viewBitmap(from, length).forEach([&](uint32_t index, bool isValue, bool negative, uint32_t bits) {
    c = list.reserve(c, 1);
    if (isValue) {
      list.addValue(c, index, std::bit_cast<float>(bits));
    } else {
      list.addSign(c, index, negative);
    }
  });
  list.finish(c);
}

// ---- onebit ---------------------------------------------------------------------------------------

// One scale per sign, the mean |acc| of the finite entries of that sign; zero counts as positive.
// The means of finite floats are finite floats.
struct OneBitScales {
  float positive = 0.0f;
  float negative = 0.0f;
};

// The sums run in double, entry by entry in index order, on both paths: the same roundings.
struct OneBitSums {
  double positive = 0, negative = 0;
  size_t nPositive = 0, nNegative = 0;

  void add(float a) {
    if (!std::isfinite(a)) return;
    if (a < 0.0f) {
      negative -= a;
      ++nNegative;
    } else {
      positive += a;
      ++nPositive;
    }
  }
  OneBitScales scales() const {
    return {nPositive ? float(positive / double(nPositive)) : 0.0f,
            nNegative ? float(negative / double(nNegative)) : 0.0f};
  }
};

// The reference: acc is already in place.
OneBitScales oneBitScales(const float* acc, size_t n) {
  OneBitSums sums;
  for (size_t i = 0; i < n; ++i) sums.add(acc[i]);
  return sums.scales();
}

// The same in the pass that forms acc = residual + input. Without a branch on the sign (random in
// a gradient): the other sum gets +0.0, which leaves it unchanged (a sum of +0.0 and non-negative
// terms is never -0.0), and non-finite entries give +0.0 to both.
OneBitScales oneBitScalesFused(std::span<const float> input, float* residual) {
  OneBitSums sums;
  for (size_t i = 0; i < input.size(); ++i) {
    const float a = residual[i] + input[i];
    residual[i] = a;
    const uint32_t bits = std::bit_cast<uint32_t>(a);
    const uint32_t finite = (bits & 0x7f800000u) != 0x7f800000u;
    const uint32_t negative = finite & (a < 0.0f);
    const uint32_t positive = finite & !negative;
    sums.positive += double(std::bit_cast<float>(bits & (0u - positive)));
    sums.negative -= double(std::bit_cast<float>(bits & (0u - negative)));
    sums.nPositive += positive;
    sums.nNegative += negative;
  }
  return sums.scales();
}

#if defined(COHORT_HAVE_AVX2_KERNELS)
// The mean of `count` non-negative terms whose sequential sum in double (the reference's) lies
// within a factor 1 +- 4 count u (u = 2^-53) of `sum`, when that interval decides it: the sum of
// count terms in any order is within gamma(count) < 1.01 count u of the exact sum, relatively (all
// terms have one sign: Higham, Accuracy and Stability of Numerical Algorithms, 4.2), so two such
// sums are within a factor (1 + gamma) / (1 - gamma) < 1 + 3 count u of each other; 4 count u also
// covers the rounding of the bounds. x -> float(x / count) never decreases, so if both ends give
// the same float, so does the sequential sum.
std::optional<float> decidedMean(double sum, size_t count) {
  if (count == 0) return 0.0f;
  const double margin = 4.0 * double(count) * 0x1p-53;
  const float low = float(sum * (1.0 - margin) / double(count));
  const float high = float(sum * (1.0 + margin) / double(count));
  if (low != high) return std::nullopt;
  return low;
}

// oneBitScalesFused with the sums in eight double lanes, which breaks the dependency chain of the
// sequential sums (each a 3-4 cycle addition per entry) but rounds differently. The means almost
// always come out the same (decidedMean); when they might not (about 1% of the calls on the cnn),
// the reference sums run over acc, now in place.
COHORT_AVX2 OneBitScales oneBitScalesAvx2(std::span<const float> input, float* residual) {
  const size_t n = input.size();
  const __m256 absMask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256 infinity = _mm256_castsi256_ps(_mm256_set1_epi32(0x7f800000));
  __m256d positive[2] = {_mm256_setzero_pd(), _mm256_setzero_pd()};
  __m256d negative[2] = {_mm256_setzero_pd(), _mm256_setzero_pd()};
  size_t nPositive = 0, nNegative = 0;
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 a = _mm256_add_ps(_mm256_loadu_ps(residual + i), _mm256_loadu_ps(input.data() + i));
    _mm256_storeu_ps(residual + i, a);
    const __m256 finite = _mm256_cmp_ps(_mm256_and_ps(a, absMask), infinity, _CMP_LT_OQ);
    const __m256 isNegative = _mm256_and_ps(_mm256_cmp_ps(a, _mm256_setzero_ps(), _CMP_LT_OQ), finite);
    const __m256 isPositive = _mm256_andnot_ps(isNegative, finite);
    const __m256 p = _mm256_and_ps(a, isPositive);
    const __m256 q = _mm256_and_ps(a, isNegative);
    positive[0] = _mm256_add_pd(positive[0], _mm256_cvtps_pd(_mm256_castps256_ps128(p)));
    positive[1] = _mm256_add_pd(positive[1], _mm256_cvtps_pd(_mm256_extractf128_ps(p, 1)));
    negative[0] = _mm256_sub_pd(negative[0], _mm256_cvtps_pd(_mm256_castps256_ps128(q)));
    negative[1] = _mm256_sub_pd(negative[1], _mm256_cvtps_pd(_mm256_extractf128_ps(q, 1)));
    nPositive += size_t(__builtin_popcount(unsigned(_mm256_movemask_ps(isPositive))));
    nNegative += size_t(__builtin_popcount(unsigned(_mm256_movemask_ps(isNegative))));
  }
  alignas(32) double lanes[2][8];
  _mm256_store_pd(lanes[0], positive[0]);
  _mm256_store_pd(lanes[0] + 4, positive[1]);
  _mm256_store_pd(lanes[1], negative[0]);
  _mm256_store_pd(lanes[1] + 4, negative[1]);
  OneBitSums sums;
  for (int lane = 0; lane < 8; ++lane) {
    sums.positive += lanes[0][lane];
    sums.negative += lanes[1][lane];
  }
  sums.nPositive = nPositive;
  sums.nNegative = nNegative;
  for (; i < n; ++i) {
    residual[i] += input[i];
    sums.add(residual[i]);
  }
  const std::optional<float> positiveMean = decidedMean(sums.positive, sums.nPositive);
  const std::optional<float> negativeMean = decidedMean(sums.negative, sums.nNegative);
  if (!positiveMean || !negativeMean) return oneBitScales(residual, n);
  return {*positiveMean, *negativeMean};
}
#endif

// The sign bitmap (in body at bitmapAt, zeroed) and acc := acc -+ scale, for entries [from, n);
// non-finite entries are escapes: value entries in the list, residual 0.
void oneBitSigns(float* acc, size_t from, size_t n, OneBitScales scales, std::vector<uint8_t>& body,
                 size_t bitmapAt, ListWriter& list, Cursor& c) {
  for (size_t i = from; i < n; ++i) {
    const float a = acc[i];
    if (!std::isfinite(a)) {
      c = list.reserve(c, 1);
      list.addValue(c, i, a);
      acc[i] = 0.0f;
    } else if (a < 0.0f) {
      body[bitmapAt + i / 8] |= uint8_t(1u << (i % 8));
      acc[i] = a + scales.negative;
    } else {
      acc[i] = a - scales.positive;
    }
  }
}

#if defined(COHORT_HAVE_AVX2_KERNELS)
// oneBitSigns, 8 entries (one bitmap byte) at a time.
COHORT_AVX2 void oneBitSignsAvx2(float* acc, size_t n, OneBitScales scales, std::vector<uint8_t>& body,
                                 size_t bitmapAt, ListWriter& list, Cursor& c) {
  const __m256 positive = _mm256_set1_ps(scales.positive);
  const __m256 negative = _mm256_set1_ps(scales.negative);
  const __m256 absMask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256 infinity = _mm256_castsi256_ps(_mm256_set1_epi32(0x7f800000));
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 a = _mm256_loadu_ps(acc + i);
    const __m256 finite = _mm256_cmp_ps(_mm256_and_ps(a, absMask), infinity, _CMP_LT_OQ);
    const __m256 isNegative = _mm256_and_ps(_mm256_cmp_ps(a, _mm256_setzero_ps(), _CMP_LT_OQ), finite);
    body[bitmapAt + i / 8] = uint8_t(_mm256_movemask_ps(isNegative));
    const __m256 r = _mm256_blendv_ps(_mm256_sub_ps(a, positive), _mm256_add_ps(a, negative), isNegative);
    _mm256_storeu_ps(acc + i, r);
    if (const unsigned escapes = ~unsigned(_mm256_movemask_ps(finite)) & 0xffu) {
      alignas(32) float values[8];
      _mm256_store_ps(values, a);
      c = list.reserve(c, 8);
      for (unsigned bits = escapes; bits != 0; bits &= bits - 1) {
        const unsigned j = unsigned(__builtin_ctz(bits));
        list.addValue(c, i + j, values[j]);
        acc[i + j] = 0.0f;
      }
    }
  }
  oneBitSigns(acc, i, n, scales, body, bitmapAt, list, c);
}
#endif

// ---- topk ------------------------------------------------------------------------------------------
//
// The k = ceil(RATIO * finite) largest finite |acc| are sent as they are (residual 0: exact), ties
// in index order, zeros never; non-finite entries too. The reference selects among all entries.
// The Fast path follows Lin et al. 2018 (DGC): it estimates from a sample of |acc| a threshold t a
// little below the k-th largest, collects in its one pass over input and residual the candidates
// with |acc| >= t, and selects exactly among those. When the candidates hold at least k finite
// entries, every entry the full selection would send is among them, so the same entries are sent:
// the sample only decides how much work the selection does. When they hold fewer (the estimate
// was too high, a 3-sigma event), it scans acc again with t = 0, every nonzero entry a candidate.

// The threshold sits at this rank (from 1) of the sample's |acc|, descending: the expected count of
// the top RATIO share in the sample plus `sigmas` standard deviations (3 by default) and a little,
// so that fewer than k entries of the buffer pass t only rarely.
size_t sampleRank(double ratio, size_t sampled, double sigmas) {
  const double expected = ratio * double(sampled);
  return size_t(std::max(1.0, std::ceil(expected + sigmas * std::sqrt(expected) + 4.0)));
}

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

size_t topKCount(double ratio, size_t finite) {
  return finite == 0 ? 0 : std::clamp<size_t>(size_t(std::ceil(ratio * double(finite))), 1, finite);
}

// Sends the k largest finite |acc| among the entries indexAt(0), ..., indexAt(count - 1)
// (increasing), ties in index order, zeros never, and every non-finite one; mags holds the finite
// |acc| of exactly those entries.
template <typename IndexAt>
void sendLargest(float* acc, size_t count, IndexAt indexAt, std::vector<float>& mags, size_t k, ListWriter& list,
                 Cursor& c) {
  const size_t finite = mags.size();
  float kth = 0.0f;
  if (k > 0 && k < finite) {
    std::nth_element(mags.begin(), mags.begin() + (finite - k), mags.end());
    kth = mags[finite - k];
  }
  size_t above = 0;  // entries strictly above kth are all sent; ties fill up to k in index order
  for (float m : mags) above += m > kth;
  size_t ties = k > above ? k - above : 0;
  for (size_t position = 0; position < count; ++position) {
    const size_t i = indexAt(position);
    const float a = acc[i];
    const float m = std::fabs(a);
    bool send = !std::isfinite(a) || m > kth;
    if (!send && m == kth && m > 0.0f && ties > 0) {
      send = true;
      --ties;
    }
    if (send) {
      c = list.reserve(c, 1);
      list.addValue(c, i, a);
      acc[i] = 0.0f;
    }
  }
}

// The reference: acc is already in place; a selection over every entry.
void encodeTopK(float* acc, size_t n, double ratio, std::vector<float>& mags, ListWriter& list, Cursor& c) {
  mags.clear();
  for (size_t i = 0; i < n; ++i) {
    if (std::isfinite(acc[i])) mags.push_back(std::fabs(acc[i]));
  }
  sendLargest(acc, n, [](size_t position) { return position; }, mags, topKCount(ratio, mags.size()), list, c);
}

// The estimate of t from 1/256 of the entries (at least 4096), one drawn from each stretch of the
// buffer: |residual + input| as the pass will compute it. 0 when the rank is beyond the sample.
// (Each draw is a cache miss or two: 1% of the cnn's buffer took longer than the pass itself.)
float sampleThreshold(std::span<const float> input, const float* residual, double ratio, TopKScratch& scratch) {
  const size_t n = input.size();
  const size_t strata = std::min(n, std::max<size_t>(n / 256, 4096));
  std::vector<float>& sample = scratch.magnitudes;
  sample.clear();
  for (size_t j = 0; j < strata; ++j) {
    const size_t lo = j * n / strata;
    const size_t hi = (j + 1) * n / strata;
    const size_t i = lo + size_t(scratch.next() % (hi - lo));
    const float m = std::fabs(residual[i] + input[i]);
    if (m < std::numeric_limits<float>::infinity()) sample.push_back(m);  // finite only
  }
  const size_t rank = sampleRank(ratio, sample.size(), fastPathTuning().topkSampleSigmas);
  if (rank > sample.size()) return 0.0f;
  std::nth_element(sample.begin(), sample.begin() + (rank - 1), sample.end(), std::greater<float>());
  return sample[rank - 1];
}

// Candidates: every i with !(|acc[i]| < t) (non-finite entries included), or with |acc[i]| > 0
// when t is 0. Fused: acc[i] = residual[i] + input[i] is formed on the way.
void collectCandidates(std::span<const float> input, float* acc, float t, bool fused, std::vector<uint32_t>& out) {
  const float least = t > 0.0f ? t : std::numeric_limits<float>::denorm_min();
  out.clear();
  for (size_t i = 0; i < input.size(); ++i) {
    float a = acc[i];
    if (fused) {
      a += input[i];
      acc[i] = a;
    }
    if (!(std::fabs(a) < least)) out.push_back(uint32_t(i));
  }
}

#if defined(COHORT_HAVE_AVX2_KERNELS)
// collectCandidates, fused, 8 entries per branch.
COHORT_AVX2 void collectCandidatesAvx2(std::span<const float> input, float* acc, float t, std::vector<uint32_t>& out) {
  const float least = t > 0.0f ? t : std::numeric_limits<float>::denorm_min();
  const __m256 leastV = _mm256_set1_ps(least);
  const __m256 absMask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  out.clear();
  size_t i = 0;
  for (; i + 8 <= input.size(); i += 8) {
    const __m256 a = _mm256_add_ps(_mm256_loadu_ps(acc + i), _mm256_loadu_ps(input.data() + i));
    _mm256_storeu_ps(acc + i, a);
    const __m256 passes = _mm256_cmp_ps(_mm256_and_ps(a, absMask), leastV, _CMP_NLT_UQ);
    for (unsigned bits = unsigned(_mm256_movemask_ps(passes)); bits != 0; bits &= bits - 1) {
      out.push_back(uint32_t(i + unsigned(__builtin_ctz(bits))));
    }
  }
  for (; i < input.size(); ++i) {
    acc[i] += input[i];
    if (!(std::fabs(acc[i]) < least)) out.push_back(uint32_t(i));
  }
}
#endif

void encodeTopKSampled(std::span<const float> input, float* residual, double ratio, TopKScratch& scratch,
                       ListWriter& list, Cursor& c) {
  const size_t n = input.size();
  std::vector<uint32_t>& candidates = scratch.candidates;
  float t = n >= fastPathTuning().topkMinSampledLength && n > 0 ? sampleThreshold(input, residual, ratio, scratch)
                                                                 : 0.0f;
#if defined(COHORT_HAVE_AVX2_KERNELS)
  if (useAvx2()) {
    collectCandidatesAvx2(input, residual, t, candidates);
  } else {
    collectCandidates(input, residual, t, true, candidates);
  }
#else
  collectCandidates(input, residual, t, true, candidates);
#endif
  float* acc = residual;
  size_t nonFinite = 0;
  std::vector<float>& mags = scratch.magnitudes;
  auto gather = [&] {
    mags.clear();
    nonFinite = 0;
    for (uint32_t i : candidates) {
      const float m = std::fabs(acc[i]);
      if (m < std::numeric_limits<float>::infinity()) {
        mags.push_back(m);
      } else {
        ++nonFinite;
      }
    }
  };
  gather();
  const size_t k = topKCount(ratio, n - nonFinite);
  if (t > 0.0f && mags.size() < k) {
    t = 0.0f;
    collectCandidates(input, acc, t, false, candidates);
    gather();
  }
  // The candidates hold every entry with |acc| >= the k-th largest of all.
  sendLargest(acc, candidates.size(), [&](size_t position) { return size_t(candidates[position]); }, mags, k, list,
              c);
}

}  // namespace

struct Encoder::Scratch {
  struct CctxDeleter {
    void operator()(ZSTD_CCtx* c) const { ZSTD_freeCCtx(c); }
  };
  std::unique_ptr<ZSTD_CCtx, CctxDeleter> cctx{ZSTD_createCCtx()};
  std::vector<uint8_t> body;
  std::vector<uint8_t> otherForm;  // the body rewritten in the other form
  TopKScratch topk;
  ListWriter list;
  BitmapWriter bitmap;
};

Encoder::Encoder(CodecSpec spec, size_t length)
    : spec_(spec), length_(length), scratch_(std::make_unique<Scratch>()) {
  COHORT_CHECK(length <= kMaxLength, InvalidArgument, "a codec buffer of ", length, " floats is beyond the limit of ",
               kMaxLength);
  // The header's body size is 32 bits: a dense body must fit (the sparse ones are checked as
  // they are made, in encode()).
  const uint64_t denseBytes = spec_.kind == CodecKind::None                                   ? 4
                              : spec_.kind == CodecKind::Fp16 || spec_.kind == CodecKind::Bf16 ? 2
                                                                                               : 0;
  COHORT_CHECK(denseBytes * length <= kMaxBodyBytes, InvalidArgument, "--codec ", kindName(spec_.kind), ": a buffer of ",
               length, " floats makes a message body of ", denseBytes * length, " bytes, beyond the format's ",
               kMaxBodyBytes, ": split it (smaller buckets, more shards)");
  if (spec_.errorFeedback()) residual_.assign(length, 0.0f);
}
Encoder::~Encoder() = default;
Encoder::Encoder(Encoder&&) noexcept = default;
Encoder& Encoder::operator=(Encoder&&) noexcept = default;

void Encoder::resetResidual() { std::fill(residual_.begin(), residual_.end(), 0.0f); }

void Encoder::setResidual(std::span<const float> residual) {
  COHORT_CHECK(residual.size() == residual_.size(), InvalidArgument, "--codec ", kindName(spec_.kind), ": a saved residual of ",
               residual.size(), " floats cannot be put back into an encoder whose residual has ", residual_.size(),
               ": restore the residual saved with this model and codec");
  std::copy(residual.begin(), residual.end(), residual_.begin());
}

std::vector<uint8_t> Encoder::encode(std::span<const float> input) {
  std::vector<uint8_t> message;
  encode(input, message);
  return message;
}

void Encoder::encode(std::span<const float> input, std::vector<uint8_t>& message) {
  COHORT_CHECK_EQ(input.size(), length_, InvalidArgument, "the input to the ", kindName(spec_.kind),
                  " encoder has the wrong length");
  message.clear();
  const size_t n = length_;
  lastSent_ = n;
  float param = 0.0f;
  switch (spec_.kind) {
    case CodecKind::None:
      message.reserve(kHeaderBytes + 4 * n);
      putHeader(message, spec_.kind, n, 0.0f, uint32_t(4 * n));
      message.resize(kHeaderBytes + 4 * n);
      if (n > 0) std::memcpy(message.data() + kHeaderBytes, input.data(), 4 * n);
      return;
    case CodecKind::Fp16:
    case CodecKind::Bf16: {
      putHeader(message, spec_.kind, n, 0.0f, uint32_t(2 * n));
      message.resize(kHeaderBytes + 2 * n);
      uint8_t* out = message.data() + kHeaderBytes;
      if (spec_.kind == CodecKind::Fp16) {
        convert::toHalf(input.data(), out, n);
      } else {
        convert::toBf16(input.data(), out, n);
      }
      return;
    }
    default: break;
  }

  // Error feedback: the residual becomes acc = input + residual, and then acc - sent. The Fast
  // path adds input in the same pass that reads acc (threshold, topk) or sums it (onebit).
  float* acc = residual_.data();
  const bool fused = codecPath() == CodecPath::Fast;
  if (!fused) accumulate(input, acc);
  std::vector<uint8_t>& body = scratch_->body;
  body.clear();
  ListWriter& list = scratch_->list;

  // topk and threshold: the pass writes one form of the list (the bitmap form on threshold's AVX2
  // path, the list form elsewhere); the other is made from it when it is the one to send.
  uint8_t form = kFormList;
  if (spec_.kind == CodecKind::TopK || spec_.kind == CodecKind::Threshold) {
    bool wroteBitmap = false;
    size_t count = 0, values = 0;
    if (spec_.kind == CodecKind::TopK) {
      param = float(spec_.ratio);
      Cursor c = list.begin(body);
      if (fused) {
        encodeTopKSampled(input, acc, spec_.ratio, scratch_->topk, list, c);
      } else {
        encodeTopK(acc, n, spec_.ratio, scratch_->topk.magnitudes, list, c);
      }
      list.finish(c);
      count = c.count;
      values = list.values();
    } else if (fused && useAvx2()) {
      param = spec_.tau;
#if defined(COHORT_HAVE_AVX2_KERNELS)
      BitmapWriter& writer = scratch_->bitmap;
      BitmapWriter::Cursor c = writer.begin(body, n);
      encodeThresholdBitmapAvx2(input, acc, spec_.tau, writer, c);
      writer.finish(c);
      wroteBitmap = true;
      count = c.count;
      values = writer.values();
#endif
    } else {
      param = spec_.tau;
      Cursor c = list.begin(body);
      if (fused) {
        encodeThresholdFused(input, acc, spec_.tau, list, c);
      } else {
        encodeThreshold(acc, n, spec_.tau, list, c);
      }
      list.finish(c);
      count = c.count;
      values = list.values();
    }
    lastSent_ = count;
    const bool sendBitmap = bitmapFormPays(n, count, values);
    if (sendBitmap != wroteBitmap) {
      std::vector<uint8_t>& other = scratch_->otherForm;
      if (sendBitmap) {
        listToBitmap(body, n, scratch_->bitmap, other);
      } else {
        bitmapToList(body, n, list, other);
      }
      body.swap(other);
    }
    if (sendBitmap) form = kFormBitmap;
  } else {  // OneBit
    OneBitScales scales;
    if (!fused) {
      scales = oneBitScales(acc, n);
    } else if (useAvx2()) {
#if defined(COHORT_HAVE_AVX2_KERNELS)
      scales = oneBitScalesAvx2(input, acc);
#endif
    } else {
      scales = oneBitScalesFused(input, acc);
    }
    putFloat32(body, scales.positive);
    putFloat32(body, scales.negative);
    const size_t bitmapAt = body.size();
    body.resize(bitmapAt + bitmapBytes(n), 0);
    Cursor c = list.begin(body);
    if (fused && useAvx2()) {
#if defined(COHORT_HAVE_AVX2_KERNELS)
      oneBitSignsAvx2(acc, n, scales, body, bitmapAt, list, c);
#endif
    } else {
      oneBitSigns(acc, 0, n, scales, body, bitmapAt, list, c);
    }
    list.finish(c);
  }

  COHORT_CHECK(body.size() <= std::numeric_limits<uint32_t>::max(), InvalidArgument, "a ", kindName(spec_.kind),
               " message body of ", body.size(), " bytes is too large; use a smaller buffer");
  const size_t bound = ZSTD_compressBound(body.size());
  COHORT_CHECK(body.size() <= kMaxBodyBytes, InvalidArgument, "--codec ", kindName(spec_.kind), ": a message body of ",
               body.size(), " bytes is beyond the format's ", kMaxBodyBytes, ": split the buffer of ", n,
               " floats (smaller buckets, more shards)");
  if (form == kFormBitmap) {
    // Raw: zstd finds next to nothing in random bitmaps (docs/BENCHMARKS.md).
    message.reserve(kHeaderBytes + body.size());
    putHeader(message, spec_.kind, n, param, uint32_t(body.size()), kFormBitmap);
    message.insert(message.end(), body.begin(), body.end());
    return;
  }
  putHeader(message, spec_.kind, n, param, uint32_t(body.size()));
  message.resize(kHeaderBytes + bound);
  const size_t got = ZSTD_compressCCtx(scratch_->cctx.get(), message.data() + kHeaderBytes, bound, body.data(),
                                       body.size(), kZstdLevel);
  COHORT_CHECK(!ZSTD_isError(got), InvalidArgument, "zstd failed to compress a codec message: ",
               ZSTD_getErrorName(got));
  message.resize(kHeaderBytes + got);
}

}  // namespace cohort::compress
