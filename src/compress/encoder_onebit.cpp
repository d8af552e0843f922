// onebit's pass (compress/encoder_internal.h): one scale per sign, the sign of every entry in a
// bitmap, the non-finite entries as value entries of a list.
#include "compress/encoder_internal.h"
#include "compress/path.h"

#include <cmath>
#include <optional>

namespace cohort::compress {

namespace {

// The means of finite floats are finite floats (OneBitScales, codec.h).

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

#if defined(COHORT_HAVE_AVX2_KERNELS)

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
void oneBitSigns(float* acc, size_t from, size_t n, OneBitScales scales, std::vector<uint8_t>& body, size_t bitmapAt,
                 ListWriter& list, Cursor& c) {
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
COHORT_AVX2 void oneBitSignsAvx2(float* acc, size_t n, OneBitScales scales, std::vector<uint8_t>& body, size_t bitmapAt,
                                 ListWriter& list, Cursor& c) {
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

}  // namespace

OneBitScales oneBitScalesOf(std::span<const float> acc) { return oneBitScales(acc.data(), acc.size()); }

std::optional<OneBitScales> oneBitScalesFromSums(double positive, uint64_t nPositive, double negative,
                                                 uint64_t nNegative) {
  const std::optional<float> p = decidedMean(positive, size_t(nPositive));
  const std::optional<float> q = decidedMean(negative, size_t(nNegative));
  if (!p || !q) return std::nullopt;
  return OneBitScales{*p, *q};
}

void encodeOneBitPass(std::span<const float> input, float* acc, bool fused, ListWriter& list,
                      std::vector<uint8_t>& body) {
  const size_t n = input.size();
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

}  // namespace cohort::compress
