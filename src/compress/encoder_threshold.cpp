// threshold's pass (compress/encoder_internal.h): every entry with |acc| >= tau, as +-tau where
// that is exact.
//
// tau has at most 8 significant bits, tau = m * 2^q with m < 2^8, so for tau <= |acc| < 2^16 tau
// both acc and tau are multiples of ulp(acc) and acc -+ tau (smaller than |acc|) is exact: a sign
// entry. Beyond that, r = fl(acc -+ tau) lies within a factor 2 of acc, so acc - r is exact
// (Sterbenz) and is sent as a value entry: +-tau up to acc's rounding, so that the step stays as
// small as Strom's however large the residual has grown. Only when tau is below half an ulp of acc
// (|acc| > 2^24 tau, r == acc) is acc sent whole; non-finite acc too.

#include "compress/encoder_internal.h"
#include "compress/path.h"

#include <array>
#include <bit>
#include <cmath>

namespace cohort::compress {

namespace {

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

}  // namespace

SparsePass encodeThresholdPass(std::span<const float> input, float* acc, float tau, bool fused, ListWriter& list,
                               BitmapWriter& bitmap, std::vector<uint8_t>& body) {
#if defined(COHORT_HAVE_AVX2_KERNELS)
  if (fused && useAvx2()) {
    BitmapWriter::Cursor c = bitmap.begin(body, input.size());
    encodeThresholdBitmapAvx2(input, acc, tau, bitmap, c);
    bitmap.finish(c);
    return {.count = c.count, .values = bitmap.values(), .wroteBitmap = true};
  }
#endif
  Cursor c = list.begin(body);
  if (fused) {
    encodeThresholdFused(input, acc, tau, list, c);
  } else {
    encodeThreshold(acc, input.size(), tau, list, c);
  }
  list.finish(c);
  return {.count = c.count, .values = list.values()};
}

}  // namespace cohort::compress
