// Which implementation the codecs run (codecPath() in codec.h), and the means to compile AVX2
// kernels inside a library built for baseline x86-64. Internal to src/compress.
#pragma once

#if defined(__x86_64__)
#include <immintrin.h>
// Kernels marked COHORT_AVX2 may use AVX2 and F16C; call them only when useAvx2() says so.
#define COHORT_HAVE_AVX2_KERNELS 1
#define COHORT_AVX2 __attribute__((target("avx2,f16c")))
#endif

#include <cstddef>

namespace cohort::compress {

// The Fast path on a CPU with AVX2 and F16C.
bool useAvx2();

// Knobs of the Fast path that change how much work it does, never its results. Process-wide; the
// tests turn them to reach rare branches.
struct FastPathTuning {
  // topk's sampled threshold sits this many standard deviations of the sample count below the
  // expected k-th largest |acc| (negative: above it, so that the rescan runs).
  double topkSampleSigmas = 3.0;
  // Buffers shorter than this skip the sample: every nonzero entry is a candidate.
  size_t topkMinSampledLength = 16384;
};
FastPathTuning fastPathTuning();
void setFastPathTuning(FastPathTuning tuning);

}  // namespace cohort::compress
