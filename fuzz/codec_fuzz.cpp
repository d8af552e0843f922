// libFuzzer target for one codec's decoder (COHORT_FUZZ_CODEC, a CodecKind; fuzz/CMakeLists.txt
// builds one binary per sparse codec and one for the dense ones; topk and threshold get both forms of
// their lists, the zstd'd list and the raw bitmap form). Whatever arrives, decodeAdd must
// either add a message's values or throw MalformedMessage leaving the buffer as it was, and never
// read out of bounds (ASan). Inputs whose length is a multiple of 3 are also used as floats for an
// encoder, checking that its messages decode, that the split into sent + residual is exact, and
// that the Fast and Reference paths (codecPath()) agree bit for bit.
#include "compress/codec.h"
#include "compress/path.h"

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <span>
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

bool sameBits(std::span<const float> a, std::span<const float> b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), 4 * a.size()) == 0);
}

void checkEncoder(const uint8_t* data, size_t size) {
  const size_t n = size / 4;
  std::vector<float> input(n);
  if (n > 0) std::memcpy(input.data(), data, 4 * n);
  const CodecSpec spec = specFor(kKind, data, size);
  Encoder enc(spec, n);
  Encoder reference(spec, n);  // the Reference path, which must agree bit for bit
  for (int step = 0; step < 2; ++step) {
    std::vector<float> before(enc.residual().begin(), enc.residual().end());
    const std::vector<uint8_t> message = enc.encode(input);
    setCodecPath(CodecPath::Reference);
    const std::vector<uint8_t> expected = reference.encode(input);
    setCodecPath(CodecPath::Fast);
    if (message != expected) fail("the fast and reference paths wrote different messages");
    if (!sameBits(enc.residual(), reference.residual())) fail("the fast and reference paths kept different residuals");
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

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  // topk samples its threshold on these short buffers too, and the onebit and threshold kernels
  // see every float the fuzzer makes.
  setFastPathTuning({.topkMinSampledLength = 0});
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::vector<uint8_t> message(data, data + size);
  if (message.size() > 5) {
    if (kKind == CodecKind::None) {
      message[5] = message[5] % 3;  // none, fp16, bf16
    } else {
      message[5] = uint8_t(kKind);
    }
  }
  // topk's and threshold's two forms (byte 6: the zstd'd list or the raw bitmap form), in equal
  // measure; the other values of the byte are refused at once.
  if (message.size() > 6 && (kKind == CodecKind::TopK || kKind == CodecKind::Threshold)) message[6] &= 1;
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
