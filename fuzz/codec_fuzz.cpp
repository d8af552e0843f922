// libFuzzer target for one codec's decoder (COHORT_FUZZ_CODEC, a CodecKind; fuzz/CMakeLists.txt
// builds one binary per sparse codec and one for the dense ones). Whatever arrives, decodeAdd must
// either add a message's values or throw MalformedMessage leaving the buffer as it was, and never
// read out of bounds (ASan). Inputs whose length is a multiple of 3 are also used as floats for an
// encoder, checking that its messages decode and that the split into sent + residual is exact.
#include "compress/codec.h"

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace {

using namespace cohort::compress;

constexpr auto kKind = CodecKind(COHORT_FUZZ_CODEC);

[[noreturn]] void fail(const char* why) {
  std::fprintf(stderr, "codec_fuzz: %s\n", why);
  std::abort();
}

CodecSpec specFor(CodecKind kind, const uint8_t* data, size_t size) {
  CodecSpec spec;
  spec.kind = kind;
  const uint8_t knob = size > 0 ? data[0] : 0;
  if (kind == CodecKind::TopK) spec.ratio = (knob % 100 + 1) / 100.0;
  if (kind == CodecKind::Threshold) spec.tau = roundTau(std::ldexp(1.3, knob % 40 - 20));
  return spec;
}

void checkEncoder(const uint8_t* data, size_t size) {
  const size_t n = size / 4;
  std::vector<float> input(n);
  if (n > 0) std::memcpy(input.data(), data, 4 * n);
  Encoder enc(specFor(kKind, data, size), n);
  for (int step = 0; step < 2; ++step) {
    std::vector<float> before(enc.residual().begin(), enc.residual().end());
    const std::vector<uint8_t> message = enc.encode(input);
    std::vector<float> sent(n, 0.0f);
    decodeAdd(message, sent);  // throws (and so crashes the run) if the encoder wrote garbage
    if (kKind != CodecKind::TopK && kKind != CodecKind::Threshold) continue;
    for (size_t i = 0; i < n; ++i) {
      const float acc = before[i] + input[i];
      const float r = enc.residual()[i];
      if (!std::isfinite(acc)) {
        if (r != 0.0f) fail("a non-finite entry left a residual");
        continue;
      }
      if (double(sent[i]) + double(r) != double(acc)) fail("sent + residual != acc");
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::vector<uint8_t> message(data, data + size);
  if (message.size() > 5) {
    if (kKind == CodecKind::None) {
      message[5] = message[5] % 3;  // none, fp16, bf16
    } else {
      message[5] = uint8_t(kKind);
    }
  }
  uint64_t length = 0;
  try {
    length = decodedLength(message);
  } catch (const MalformedMessage&) {
    length = 0;
  }
  if (length > (1u << 20)) return 0;  // a valid header for a buffer too large to fuzz with
  std::vector<float> out(length, 1.0f);
  try {
    decodeAdd(message, out, 0.5f);
  } catch (const MalformedMessage&) {
    for (float v : out) {
      if (std::bit_cast<uint32_t>(v) != std::bit_cast<uint32_t>(1.0f)) fail("a rejected message changed the buffer");
    }
  }
  if (size % 3 == 0 && size <= 4096) checkEncoder(data, size);
  return 0;
}
