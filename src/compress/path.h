// Which implementation the codecs run (codecPath() in codec.h), and the means to compile AVX2
// kernels inside a library built for baseline x86-64. Internal to src/compress.
#pragma once

#if defined(__x86_64__)
#include <immintrin.h>
// Kernels marked COHORT_AVX2 may use AVX2 and F16C; call them only when useAvx2() says so.
#define COHORT_HAVE_AVX2_KERNELS 1
#define COHORT_AVX2 __attribute__((target("avx2,f16c")))
#endif

namespace cohort::compress {

// The Fast path on a CPU with AVX2 and F16C.
bool useAvx2();

}  // namespace cohort::compress
