// What the encoder (encoder.cpp) and the decoder (codec.cpp) agree on: the message header's
// constants. The layout is in docs/ARCHITECTURE.md ("Message format"). Internal to src/compress.
#pragma once

#include "compress/codec.h"

#include <bit>
#include <cstddef>
#include <cstdint>

namespace cohort::compress {

// The encoder writes and the decoder reads the little-endian layout (bitmap words, floats, 16-bit
// values) with the host's byte order.
static_assert(std::endian::native == std::endian::little, "the codec messages assume a little-endian host");

inline constexpr uint8_t kMagic[4] = {'C', 'O', 'C', 'M'};
inline constexpr uint8_t kVersion = 1;

inline size_t bitmapBytes(uint64_t bits) { return size_t((bits + 7) / 8); }

// "none", "fp16", ...: the name --codec uses.
const char* kindName(CodecKind kind);

}  // namespace cohort::compress
