// The 16-bit conversions behind the dense codecs and the span functions of codec.h, on raw
// buffers of any alignment: the scalar code (the reference) and AVX2/F16C kernels, chosen per call
// by useAvx2() (path.h). Internal to src/compress.
#pragma once

#include <cstddef>

namespace cohort::compress::convert {

// in: n floats; out: 2n bytes of binary16 or bfloat16 values, little-endian (the wire's order).
void toHalf(const float* in, void* out, size_t n);
void toBf16(const float* in, void* out, size_t n);

// in: 2n bytes as written above. out[i] = the float of in[i].
void fromHalf(const void* in, float* out, size_t n);
void fromBf16(const void* in, float* out, size_t n);

// out[i] += scale * (the float of in[i]): one multiplication and one addition, both rounded.
void addHalf(const void* in, float* out, size_t n, float scale);
void addBf16(const void* in, float* out, size_t n, float scale);

}  // namespace cohort::compress::convert
