// topk's pass (compress/encoder_internal.h).
//
// The k = ceil(RATIO * finite) largest finite |acc| are sent as they are (residual 0: exact), ties
// in index order, zeros never; non-finite entries too. The reference selects among all entries.
// The Fast path follows Lin et al. 2018 (DGC): it estimates from a sample of |acc| a threshold t a
// little below the k-th largest, collects in its one pass over input and residual the candidates
// with |acc| >= t, and selects exactly among those. When the candidates hold at least k finite
// entries, every entry the full selection would send is among them, so the same entries are sent:
// the sample only decides how much work the selection does. When they hold fewer (the estimate
// was too high, a 3-sigma event), it scans acc again with t = 0, every nonzero entry a candidate.

#include "compress/encoder_internal.h"
#include "compress/path.h"

#include <cmath>
#include <functional>
#include <limits>

namespace cohort::compress {

namespace {

// The threshold sits at this rank (from 1) of the sample's |acc|, descending: the expected count of
// the top RATIO share in the sample plus `sigmas` standard deviations (3 by default) and a little,
// so that fewer than k entries of the buffer pass t only rarely.
size_t sampleRank(double ratio, size_t sampled, double sigmas) {
  const double expected = ratio * double(sampled);
  return size_t(std::max(1.0, std::ceil(expected + sigmas * std::sqrt(expected) + 4.0)));
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
  sendLargest(
      acc, n, [](size_t position) { return position; }, mags, topKCount(ratio, mags.size()), list, c);
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
  float t =
      n >= fastPathTuning().topkMinSampledLength && n > 0 ? sampleThreshold(input, residual, ratio, scratch) : 0.0f;
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
  sendLargest(
      acc, candidates.size(), [&](size_t position) { return size_t(candidates[position]); }, mags, k, list, c);
}

}  // namespace

size_t topKCount(double ratio, size_t finite) {
  return finite == 0 ? 0 : std::clamp<size_t>(size_t(std::ceil(ratio * double(finite))), 1, finite);
}

SparsePass encodeTopKPass(std::span<const float> input, float* acc, double ratio, bool fused, TopKScratch& scratch,
                          ListWriter& list, std::vector<uint8_t>& body) {
  Cursor c = list.begin(body);
  if (fused) {
    encodeTopKSampled(input, acc, ratio, scratch, list, c);
  } else {
    encodeTopK(acc, input.size(), ratio, scratch.magnitudes, list, c);
  }
  list.finish(c);
  return {.count = c.count, .values = list.values()};
}

}  // namespace cohort::compress
