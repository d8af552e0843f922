// binary16 and bfloat16 conversions: the scalar functions, which define the rounding, and AVX2 /
// F16C kernels that give the same bits. The kernels are compiled with function target attributes,
// so the rest of the library stays baseline x86-64, and run only where the CPU reports AVX2 and
// F16C (checked once at run time).
//
// Where the hardware and the definition differ, the kernels fix the lanes up:
//   - fp16, float -> half: vcvtps2ph rounds finite values >= 65520 to infinity (the definition
//     saturates them to +-65504) and keeps a NaN's payload (the definition sends the canonical
//     quiet NaN, sign kept). Both concern only lanes with |x| >= 65520, tested for as a group.
//   - fp16, half -> float: vcvtph2ps quiets a signalling NaN (the definition keeps the bits).
//   - bf16 has no conversion instruction in AVX2: the rounding is done in 32-bit integer lanes,
//     the scalar code's steps side by side.
#include "compress/convert.h"

#include "compress/codec.h"
#include "compress/path.h"

#include <algorithm>
#include <bit>
#include <cstring>

namespace cohort::compress {

// The kernels read and write the wire's little-endian 16-bit values in place.
static_assert(std::endian::native == std::endian::little, "the codec conversions assume a little-endian host");

namespace {

uint16_t load16(const void* base, size_t i) {
  uint16_t bits;
  std::memcpy(&bits, static_cast<const uint8_t*>(base) + 2 * i, 2);
  return bits;
}
void store16(void* base, size_t i, uint16_t bits) { std::memcpy(static_cast<uint8_t*>(base) + 2 * i, &bits, 2); }

}  // namespace

// ---- the definition: scalar ---------------------------------------------------------------------

uint16_t floatToHalf(float value) {
  const uint32_t x = std::bit_cast<uint32_t>(value);
  const uint16_t sign = uint16_t((x >> 16) & 0x8000);
  const uint32_t ax = x & 0x7fffffff;
  if (ax > 0x7f800000) return sign | 0x7e00;  // NaN
  if (ax == 0x7f800000) return sign | 0x7c00;
  if (ax >= 0x477ff000) return sign | 0x7bff;  // >= 65520 would round to infinity: saturate
  if (ax < 0x38800000) {
    // Below 2^-14: a multiple of the subnormal step 2^-24, in integers (gradients have many such
    // entries, and a libm rounding call per entry is slow). ax = m * 2^(e - 150), so the number of
    // steps is m * 2^(e - 126): m shifted right by 126 - e, rounded to nearest even.
    const uint32_t e = ax >> 23;
    if (e < 102) return sign;  // below 2^-25 (or exactly it: a tie, to even): zero
    const uint32_t m = (ax & 0x7fffff) | 0x800000;
    const uint32_t shift = 126 - e;  // 14..24
    uint32_t q = m >> shift;
    const uint32_t rest = m & ((1u << shift) - 1);
    const uint32_t half = 1u << (shift - 1);
    q += (rest > half || (rest == half && (q & 1))) ? 1 : 0;
    return sign | uint16_t(q);
  }
  uint32_t v = ax - (112u << 23);  // exponent bias 127 -> 15
  v += 0xfff + ((v >> 13) & 1);    // round to nearest even; a carry moves into the exponent
  return sign | uint16_t(v >> 13);
}

float halfToFloat(uint16_t bits) {
  const uint32_t sign = uint32_t(bits & 0x8000) << 16;
  const uint32_t exponent = (bits >> 10) & 0x1f;
  const uint32_t mantissa = bits & 0x3ff;
  if (exponent == 0) {
    const float v = float(mantissa) * 0x1p-24f;
    return sign ? -v : v;
  }
  if (exponent == 31) return std::bit_cast<float>(sign | 0x7f800000 | (mantissa << 13));
  return std::bit_cast<float>(sign | ((exponent + 112) << 23) | (mantissa << 13));
}

uint16_t floatToBf16(float value) {
  const uint32_t x = std::bit_cast<uint32_t>(value);
  const uint32_t ax = x & 0x7fffffff;
  if (ax > 0x7f800000) return uint16_t(x >> 16) | 0x40;  // NaN, kept quiet
  if (ax == 0x7f800000) return uint16_t(x >> 16);
  const uint32_t rounded = x + 0x7fff + ((x >> 16) & 1);
  if ((rounded & 0x7f800000) == 0x7f800000) return uint16_t((x >> 16) & 0x8000) | 0x7f7f;  // saturate
  return uint16_t(rounded >> 16);
}

float bf16ToFloat(uint16_t bits) { return std::bit_cast<float>(uint32_t(bits) << 16); }

// ---- AVX2 / F16C kernels, 8 lanes -----------------------------------------------------------------

#if defined(COHORT_HAVE_AVX2_KERNELS)
namespace {

// 8 values below 2^16 in 32-bit lanes, packed into 16-bit lanes in order.
COHORT_AVX2 inline __m128i narrow(__m256i v) {
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(v, v), 0x08));
}
// 8 masks (0 or all ones) in 32-bit lanes, as 16-bit masks.
COHORT_AVX2 inline __m128i narrowMask(__m256i m) {
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packs_epi32(m, m), 0x08));
}

COHORT_AVX2 inline __m128i halfOf8(__m256 v) {
  const __m128i rounded = _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT);
  const __m256i x = _mm256_castps_si256(v);
  const __m256i ax = _mm256_and_si256(x, _mm256_set1_epi32(0x7fffffff));
  const __m256i big = _mm256_cmpgt_epi32(ax, _mm256_set1_epi32(0x477fefff));  // >= 65520, inf, NaN
  if (_mm256_testz_si256(big, big)) return rounded;
  const __m256i inf = _mm256_set1_epi32(0x7f800000);
  __m256i fix = _mm256_set1_epi32(0x7bff);
  fix = _mm256_blendv_epi8(fix, _mm256_set1_epi32(0x7c00), _mm256_cmpeq_epi32(ax, inf));
  fix = _mm256_blendv_epi8(fix, _mm256_set1_epi32(0x7e00), _mm256_cmpgt_epi32(ax, inf));
  fix = _mm256_or_si256(fix, _mm256_and_si256(_mm256_srli_epi32(x, 16), _mm256_set1_epi32(0x8000)));
  return _mm_blendv_epi8(rounded, narrow(fix), narrowMask(big));
}

COHORT_AVX2 inline __m256 floatOfHalf8(__m128i h) {
  const __m256 f = _mm256_cvtph_ps(h);
  const __m128i nan = _mm_cmpgt_epi16(_mm_and_si128(h, _mm_set1_epi16(0x7fff)), _mm_set1_epi16(0x7c00));
  if (_mm_testz_si128(nan, nan)) return f;
  const __m256i h32 = _mm256_cvtepu16_epi32(h);
  // A NaN's exponent 31 becomes 255 and its payload moves up unchanged.
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(h32, _mm256_set1_epi32(0x8000)), 16);
  const __m256i rest = _mm256_add_epi32(_mm256_slli_epi32(_mm256_and_si256(h32, _mm256_set1_epi32(0x7fff)), 13),
                                        _mm256_set1_epi32((255 - 31) << 23));
  const __m256 bits = _mm256_castsi256_ps(_mm256_or_si256(sign, rest));
  return _mm256_blendv_ps(f, bits, _mm256_castsi256_ps(_mm256_cvtepi16_epi32(nan)));
}

COHORT_AVX2 inline __m128i bf16Of8(__m256 v) {
  const __m256i x = _mm256_castps_si256(v);
  const __m256i high = _mm256_srli_epi32(x, 16);
  const __m256i rounded = _mm256_add_epi32(_mm256_add_epi32(x, _mm256_set1_epi32(0x7fff)),
                                           _mm256_and_si256(high, _mm256_set1_epi32(1)));
  __m256i result = _mm256_srli_epi32(rounded, 16);
  const __m256i exponent = _mm256_set1_epi32(0x7f800000);
  const __m256i ax = _mm256_and_si256(x, _mm256_set1_epi32(0x7fffffff));
  const __m256i nonFinite = _mm256_cmpgt_epi32(ax, _mm256_set1_epi32(0x7f7fffff));
  const __m256i overflow = _mm256_cmpeq_epi32(_mm256_and_si256(rounded, exponent), exponent);
  const __m256i special = _mm256_or_si256(nonFinite, overflow);
  if (!_mm256_testz_si256(special, special)) {
    const __m256i saturated = _mm256_or_si256(_mm256_and_si256(high, _mm256_set1_epi32(0x8000)),
                                              _mm256_set1_epi32(0x7f7f));
    result = _mm256_blendv_epi8(result, saturated, overflow);
    const __m256i nan = _mm256_cmpgt_epi32(ax, exponent);
    const __m256i kept = _mm256_or_si256(high, _mm256_and_si256(nan, _mm256_set1_epi32(0x40)));
    result = _mm256_blendv_epi8(result, kept, nonFinite);
  }
  return narrow(result);
}

COHORT_AVX2 inline __m256 floatOfBf16x8(__m128i h) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// out[i] = binary16 (Half) or bfloat16 of in[i].
template <bool Half>
COHORT_AVX2 void toAvx2(const float* in, void* out, size_t n) {
  auto* o = static_cast<uint8_t*>(out);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(in + i);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(o + 2 * i), Half ? halfOf8(v) : bf16Of8(v));
  }
  for (; i < n; ++i) store16(out, i, Half ? floatToHalf(in[i]) : floatToBf16(in[i]));
}

// out[i] = f(in[i]) (Add false) or out[i] += scale * f(in[i]) (Add true).
template <bool Add, bool Half>
COHORT_AVX2 void fromAvx2(const void* in, float* out, size_t n, float scale) {
  const auto* b = static_cast<const uint8_t*>(in);
  const __m256 s = _mm256_set1_ps(scale);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2 * i));
    const __m256 f = Half ? floatOfHalf8(h) : floatOfBf16x8(h);
    if constexpr (Add) {
      _mm256_storeu_ps(out + i, _mm256_add_ps(_mm256_loadu_ps(out + i), _mm256_mul_ps(s, f)));
    } else {
      _mm256_storeu_ps(out + i, f);
    }
  }
  for (; i < n; ++i) {
    const float f = Half ? halfToFloat(load16(in, i)) : bf16ToFloat(load16(in, i));
    if constexpr (Add) {
      out[i] += scale * f;
    } else {
      out[i] = f;
    }
  }
}

}  // namespace
#endif

// ---- dispatch -------------------------------------------------------------------------------------

namespace convert {

void toHalf(const float* in, void* out, size_t n) {
#if defined(COHORT_HAVE_AVX2_KERNELS)
  if (useAvx2()) return toAvx2<true>(in, out, n);
#endif
  for (size_t i = 0; i < n; ++i) store16(out, i, floatToHalf(in[i]));
}

void toBf16(const float* in, void* out, size_t n) {
#if defined(COHORT_HAVE_AVX2_KERNELS)
  if (useAvx2()) return toAvx2<false>(in, out, n);
#endif
  for (size_t i = 0; i < n; ++i) store16(out, i, floatToBf16(in[i]));
}

void fromHalf(const void* in, float* out, size_t n) {
#if defined(COHORT_HAVE_AVX2_KERNELS)
  if (useAvx2()) return fromAvx2<false, true>(in, out, n, 1.0f);
#endif
  for (size_t i = 0; i < n; ++i) out[i] = halfToFloat(load16(in, i));
}

void fromBf16(const void* in, float* out, size_t n) {
#if defined(COHORT_HAVE_AVX2_KERNELS)
  if (useAvx2()) return fromAvx2<false, false>(in, out, n, 1.0f);
#endif
  for (size_t i = 0; i < n; ++i) out[i] = bf16ToFloat(load16(in, i));
}

void addHalf(const void* in, float* out, size_t n, float scale) {
#if defined(COHORT_HAVE_AVX2_KERNELS)
  if (useAvx2()) return fromAvx2<true, true>(in, out, n, scale);
#endif
  for (size_t i = 0; i < n; ++i) out[i] += scale * halfToFloat(load16(in, i));
}

void addBf16(const void* in, float* out, size_t n, float scale) {
#if defined(COHORT_HAVE_AVX2_KERNELS)
  if (useAvx2()) return fromAvx2<true, false>(in, out, n, scale);
#endif
  for (size_t i = 0; i < n; ++i) out[i] += scale * bf16ToFloat(load16(in, i));
}

}  // namespace convert

// ---- the span forms ---------------------------------------------------------------------------------

void floatsToHalf(std::span<const float> in, std::span<uint16_t> out) {
  COHORT_CHECK_EQ(out.size(), in.size(), InvalidArgument, "floatsToHalf: the output's size");
  convert::toHalf(in.data(), out.data(), in.size());
}
void halfToFloats(std::span<const uint16_t> in, std::span<float> out) {
  COHORT_CHECK_EQ(out.size(), in.size(), InvalidArgument, "halfToFloats: the output's size");
  convert::fromHalf(in.data(), out.data(), in.size());
}
void floatsToBf16(std::span<const float> in, std::span<uint16_t> out) {
  COHORT_CHECK_EQ(out.size(), in.size(), InvalidArgument, "floatsToBf16: the output's size");
  convert::toBf16(in.data(), out.data(), in.size());
}
void bf16ToFloats(std::span<const uint16_t> in, std::span<float> out) {
  COHORT_CHECK_EQ(out.size(), in.size(), InvalidArgument, "bf16ToFloats: the output's size");
  convert::fromBf16(in.data(), out.data(), in.size());
}

namespace {

// 4096 entries: 16 KiB of acc and 8 KiB of each 16-bit buffer, so the rounding pass reads acc from
// L1 where the addition left it.
constexpr size_t kRoundBlock = 4096;

template <typename Add, typename Round>
void addAndRound(std::span<const uint16_t> received, std::span<float> acc, std::span<uint16_t> rounded, Add add,
                 Round round, const char* who) {
  COHORT_CHECK_EQ(acc.size(), received.size(), InvalidArgument, who, ": the accumulator's size");
  COHORT_CHECK_EQ(rounded.size(), received.size(), InvalidArgument, who, ": the output's size");
  for (size_t begin = 0; begin < acc.size(); begin += kRoundBlock) {
    const size_t n = std::min(kRoundBlock, acc.size() - begin);
    add(received.data() + begin, acc.data() + begin, n, 1.0f);
    round(acc.data() + begin, rounded.data() + begin, n);
  }
}

}  // namespace

void addHalfAndRound(std::span<const uint16_t> received, std::span<float> acc, std::span<uint16_t> rounded) {
  addAndRound(received, acc, rounded, convert::addHalf, convert::toHalf, "addHalfAndRound");
}
void addBf16AndRound(std::span<const uint16_t> received, std::span<float> acc, std::span<uint16_t> rounded) {
  addAndRound(received, acc, rounded, convert::addBf16, convert::toBf16, "addBf16AndRound");
}

}  // namespace cohort::compress
