// The codec spec, the message header and the hostile-input decoder (the encoders are in
// encoder.cpp). Layout and arithmetic are documented in docs/ARCHITECTURE.md ("Compression").
#include "compress/codec.h"

#include "base/coding.h"
#include "compress/convert.h"
#include "compress/format.h"
#include "compress/path.h"

#include <zstd.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>

namespace cohort::compress {

namespace {

// A header's parameter as %g writes it: 1e-45 is not "0.000000".
std::string shortNumber(float value) {
  char text[32];
  std::snprintf(text, sizeof(text), "%g", double(value));
  return text;
}

[[noreturn]] void malformed(const std::string& why) {
  throw MalformedMessage("malformed codec message: " + why);
}

// ---- reading -----------------------------------------------------------------------------------

// The codec's reads: every read that does not fit is a MalformedMessage naming `what`.
class Reader {
 public:
  Reader(const uint8_t* data, size_t size, const char* what) : in_(data, size), what_(what) {}

  size_t left() const { return in_.left(); }
  const uint8_t* position() const { return in_.position(); }
  const uint8_t* take(size_t n) {
    const uint8_t* at = in_.take(n);
    if (at == nullptr) truncated();
    return at;
  }
  uint32_t u32() { return decodeFixed32(take(4)); }
  uint64_t u64() { return decodeFixed64(take(8)); }
  float f32() { return std::bit_cast<float>(u32()); }
  uint32_t varint() {
    uint32_t v = 0;
    for (int shift = 0; shift < 35; shift += 7) {
      const uint8_t b = *take(1);
      if (shift == 28 && b > 0x0f) malformed(std::string(what_) + " has a varint beyond 32 bits");
      v |= uint32_t(b & 0x7f) << shift;
      if (!(b & 0x80)) {
        if (b == 0 && shift > 0) malformed(std::string(what_) + " has an overlong varint");
        return v;
      }
    }
    malformed(std::string(what_) + " has a varint beyond 32 bits");
  }
  void expectEnd() {
    if (left() != 0) malformed(std::string(what_) + " has " + std::to_string(left()) + " trailing bytes");
  }

 private:
  [[noreturn]] void truncated() const { malformed(std::string(what_) + " is truncated"); }

  ByteReader in_;
  const char* what_;
};

void checkPadding(const uint8_t* bitmap, uint64_t bits, const char* what) {
  if (bits % 8 != 0 && (bitmap[bits / 8] >> (bits % 8)) != 0) {
    malformed(std::string(what) + " has bits set past its end");
  }
}

// Reads and checks a sparse list for a buffer of `length` entries.
ListView readList(Reader& in, uint64_t length, bool signEntriesAllowed) {
  ListView list;
  const uint32_t n = in.u32();
  if (n > length) malformed("the list has " + std::to_string(n) + " entries for a length of " + std::to_string(length));
  list.count = n;
  list.varints = in.position();
  uint64_t prev = 0;
  for (uint32_t i = 0; i < n; ++i) {
    const uint32_t delta = in.varint();
    if (i > 0 && delta == 0) malformed("index " + std::to_string(prev) + " is repeated");
    const uint64_t index = i == 0 ? delta : prev + delta;
    if (index >= length) {
      malformed("index " + std::to_string(index) + " is out of range for a length of " + std::to_string(length));
    }
    prev = index;
  }
  const size_t bitmap = bitmapBytes(n);
  list.isValue = in.take(bitmap);
  list.negative = in.take(bitmap);
  checkPadding(list.isValue, n, "the value-entry bitmap");
  checkPadding(list.negative, n, "the sign bitmap");
  size_t values = 0;
  for (size_t b = 0; b < bitmap; ++b) {
    if (list.isValue[b] & list.negative[b]) malformed("a value entry has its sign bit set");
    // The padding bits are zero (checked above): a full last byte is what a full list has.
    const uint8_t full = b + 1 < bitmap || n % 8 == 0 ? 0xff : uint8_t((1u << (n % 8)) - 1);
    if (!signEntriesAllowed && list.isValue[b] != full) malformed("this codec's list has a sign entry");
    values += size_t(std::popcount(list.isValue[b]));
  }
  list.values = in.take(4 * values);
  return list;
}

// Reads and checks a bitmap-form body for a buffer of `length` entries: counts within bounds and
// equal to the sent bitmap's bits, ordinals increasing and in range, padding bits zero.
BitmapView readBitmap(Reader& in, uint64_t length, bool signEntriesAllowed) {
  BitmapView view;
  view.length = length;
  const uint32_t n = in.u32();
  const uint32_t v = in.u32();
  if (n > length) malformed("the bitmap form has " + std::to_string(n) + " entries for a length of " + std::to_string(length));
  if (v > n) malformed("the bitmap form has " + std::to_string(v) + " value entries of " + std::to_string(n));
  if (!signEntriesAllowed && v != n) malformed("this codec's list has a sign entry");
  view.count = n;
  view.valueCount = v;
  auto countBits = [](const uint8_t* bitmap, size_t bytes) {
    uint64_t bits = 0;
    size_t b = 0;
    for (; b + 8 <= bytes; b += 8) {
      uint64_t word;
      std::memcpy(&word, bitmap + b, 8);
      bits += uint64_t(std::popcount(word));
    }
    for (; b < bytes; ++b) bits += uint64_t(std::popcount(bitmap[b]));
    return bits;
  };
  view.sent = in.take(bitmapBytes(length));
  checkPadding(view.sent, length, "the sent bitmap");
  if (const uint64_t set = countBits(view.sent, bitmapBytes(length)); set != n) {
    malformed("the sent bitmap has " + std::to_string(set) + " bits set, the count says " + std::to_string(n));
  }
  if (v > 0 && v < n) {
    view.ordinals = in.take(4 * size_t(v));
    uint64_t previous = 0;
    for (uint32_t i = 0; i < v; ++i) {
      uint32_t ordinal;
      std::memcpy(&ordinal, view.ordinals + 4 * size_t(i), 4);
      if (ordinal >= n) malformed("value entry ordinal " + std::to_string(ordinal) + " of " + std::to_string(n) + " entries");
      if (i > 0 && ordinal <= previous) malformed("the value entries' ordinals are not increasing");
      previous = ordinal;
    }
  }
  view.negative = in.take(bitmapBytes(n - v));
  checkPadding(view.negative, n - v, "the sign bitmap");
  view.values = in.take(4 * size_t(v));
  return view;
}

// The 64 sign bits of a bitmap-form body from sign entry `at` on (zero past the end).
uint64_t signsFrom(const BitmapView& view, size_t at) {
  const size_t bytes = bitmapBytes(view.count - view.valueCount);
  const size_t byte = at / 8;
  uint8_t window[16] = {};
  std::memcpy(window, view.negative + byte, std::min<size_t>(9, bytes - byte));
  uint64_t low = 0;
  std::memcpy(&low, window, 8);
  const unsigned shift = unsigned(at % 8);
  return shift == 0 ? low : (low >> shift) | uint64_t(window[8]) << (64 - shift);
}

// out[index] += (sign bit ? minus : plus) for a bitmap-form body of sign entries only: per 64-bit
// word of the sent bitmap, the next popcount sign bits, and a loop over the word's set bits.
void addSignEntriesScalar(const BitmapView& view, float plus, float minus, float* out) {
  const float delta[2] = {plus, minus};
  size_t sign = 0;
  for (size_t w = 0; 64 * w < view.length; ++w) {
    uint64_t m = view.sentWord(w);
    if (m == 0) continue;
    uint64_t s = signsFrom(view, sign);
    sign += size_t(std::popcount(m));
    float* o = out + 64 * w;
    for (; m != 0; m &= m - 1) {
      o[std::countr_zero(m)] += delta[s & 1];
      s >>= 1;
    }
  }
}

#if defined(COHORT_HAVE_AVX2_KERNELS)
// kRanks[mask][j]: how many bits of mask lie below bit j (the sign bit's place for entry j).
constexpr auto kRanks = [] {
  std::array<std::array<int32_t, 8>, 256> table{};
  for (unsigned mask = 0; mask < 256; ++mask) {
    for (unsigned j = 0; j < 8; ++j) table[mask][j] = std::popcount(mask & ((1u << j) - 1));
  }
  return table;
}();

// The same, 8 entries at a time without a branch per entry: lane j of a block takes sign bit
// rank(j) of the block's bits (kRanks) and adds +-tau where the sent bit is set; the other lanes
// keep their value, bit for bit.
COHORT_AVX2 void addSignEntriesAvx2(const BitmapView& view, float plus, float minus, float* out) {
  const __m256i lanes = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  const __m256 plusV = _mm256_set1_ps(plus);
  const __m256 minusV = _mm256_set1_ps(minus);
  const size_t full = view.length / 8;  // whole blocks; the rest goes the scalar way
  size_t sign = 0;
  for (size_t w = 0; 8 * w < full; ++w) {
    const uint64_t word = view.sentWord(w);
    if (word == 0) continue;
    uint64_t s = signsFrom(view, sign);
    const size_t blocks = std::min<size_t>(8, full - 8 * w);
    for (size_t b = 0; b < blocks; ++b) {
      const unsigned m = unsigned(word >> (8 * b)) & 0xffu;
      const __m256i ranks = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(kRanks[m].data()));
      const __m256i negative = _mm256_slli_epi32(_mm256_srlv_epi32(_mm256_set1_epi32(int(uint32_t(s))), ranks), 31);
      const __m256 delta = _mm256_blendv_ps(plusV, minusV, _mm256_castsi256_ps(negative));
      const __m256i sentLanes = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(int(m)), lanes), lanes);
      float* o = out + 64 * w + 8 * b;
      const __m256 before = _mm256_loadu_ps(o);
      _mm256_storeu_ps(o, _mm256_blendv_ps(before, _mm256_add_ps(before, delta), _mm256_castsi256_ps(sentLanes)));
      s >>= std::popcount(m);
      sign += size_t(std::popcount(m));
    }
  }
  const float delta[2] = {plus, minus};
  for (size_t i = 8 * full; i < view.length; ++i) {
    if (bitAt(view.sent, i)) out[i] += delta[(signsFrom(view, sign++) & 1)];
  }
}
#endif

void addSignEntries(const BitmapView& view, float plus, float minus, float* out) {
#if defined(COHORT_HAVE_AVX2_KERNELS)
  if (useAvx2()) return addSignEntriesAvx2(view, plus, minus, out);
#endif
  addSignEntriesScalar(view, plus, minus, out);
}

// out[i] += (sign bit i ? minus : plus) for i in [from, to).
void addOneBitSignsScalar(const uint8_t* signs, size_t from, size_t to, float plus, float minus, float* out) {
  for (size_t i = from; i < to; ++i) out[i] += bitAt(signs, i) ? minus : plus;
}

#if defined(COHORT_HAVE_AVX2_KERNELS)
// The same, a bitmap byte (8 entries) at a time where the range allows.
COHORT_AVX2 void addOneBitSignsAvx2(const uint8_t* signs, size_t from, size_t to, float plus, float minus,
                                    float* out) {
  const size_t blocksFrom = std::min(to, (from + 7) / 8 * 8);
  addOneBitSignsScalar(signs, from, blocksFrom, plus, minus, out);
  const __m256i lanes = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  const __m256 plusV = _mm256_set1_ps(plus);
  const __m256 minusV = _mm256_set1_ps(minus);
  size_t i = blocksFrom;
  for (; i + 8 <= to; i += 8) {
    const __m256i byte = _mm256_set1_epi32(signs[i / 8]);
    const __m256 negative = _mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_and_si256(byte, lanes), lanes));
    _mm256_storeu_ps(out + i, _mm256_add_ps(_mm256_loadu_ps(out + i), _mm256_blendv_ps(plusV, minusV, negative)));
  }
  addOneBitSignsScalar(signs, i, to, plus, minus, out);
}
#endif

void addOneBitSigns(const uint8_t* signs, size_t from, size_t to, float plus, float minus, float* out) {
#if defined(COHORT_HAVE_AVX2_KERNELS)
  if (useAvx2()) return addOneBitSignsAvx2(signs, from, to, plus, minus, out);
#endif
  addOneBitSignsScalar(signs, from, to, plus, minus, out);
}

size_t elementBytes(CodecKind kind) {
  switch (kind) {
    case CodecKind::None: return 4;
    case CodecKind::Fp16:
    case CodecKind::Bf16: return 2;
    default: return 0;
  }
}

// The largest decompressed body a sparse message of `length` entries may claim: a list of at most
// `length` entries (u32 count, varints of at most 5 bytes, two bitmaps, floats), plus onebit's
// scales and sign bitmap.
uint64_t maxSparseBody(CodecKind kind, uint64_t length) {
  const uint64_t list = 4 + 5 * length + 2 * bitmapBytes(length) + 4 * length;
  return kind == CodecKind::OneBit ? list + 8 + bitmapBytes(length) : list;
}

struct Parsed {
  MessageInfo info;
  uint8_t form = kFormList;
  uint32_t bodyBytes = 0;
  const uint8_t* body = nullptr;
  size_t bodySize = 0;  // bytes after the header
};

Parsed parseHeader(std::span<const uint8_t> message) {
  Reader in(message.data(), message.size(), "the message header");
  const uint8_t* magic = in.take(4);
  if (std::memcmp(magic, kMagic, 4) != 0) malformed("it does not start with the codec magic 'COCM'");
  const uint8_t version = *in.take(1);
  if (version != kVersion) malformed("version " + std::to_string(version) + " (this build reads version 1)");
  const uint8_t kind = *in.take(1);
  if (kind > uint8_t(CodecKind::OneBit)) malformed("unknown codec " + std::to_string(kind));
  const uint8_t form = *in.take(1);
  if (*in.take(1) != 0) malformed("the reserved header byte is not zero");
  const bool listed = kind == uint8_t(CodecKind::TopK) || kind == uint8_t(CodecKind::Threshold);
  if (form != kFormList && !(form == kFormBitmap && listed)) {
    malformed("form " + std::to_string(form) + " for codec " + std::to_string(kind) + " (topk and threshold take " +
              std::to_string(kFormList) + " or " + std::to_string(kFormBitmap) + ", the others " +
              std::to_string(kFormList) + ")");
  }
  Parsed p;
  p.form = form;
  p.info.kind = CodecKind(kind);
  p.info.length = in.u64();
  p.info.param = in.f32();
  p.bodyBytes = in.u32();
  p.body = message.data() + kHeaderBytes;
  p.bodySize = message.size() - kHeaderBytes;
  if (p.info.length > kMaxLength) {
    malformed("length " + std::to_string(p.info.length) + " is beyond the limit of " + std::to_string(kMaxLength));
  }
  const float param = p.info.param;
  switch (p.info.kind) {
    case CodecKind::TopK:
      if (!(param > 0.0f && param <= 1.0f)) malformed("topk ratio " + shortNumber(param) + " is not in (0, 1]");
      break;
    case CodecKind::Threshold:
      if (!(param > 0.0f && std::isfinite(param)))
        malformed("threshold tau " + shortNumber(param) + " is not positive");
      break;
    default:
      if (std::bit_cast<uint32_t>(param) != 0) malformed("a parameter for a codec that has none");
  }
  if (const size_t elem = elementBytes(p.info.kind)) {
    if (uint64_t(p.bodyBytes) != p.info.length * elem || p.bodySize != p.bodyBytes) {
      malformed("a dense body of " + std::to_string(p.bodySize) + " bytes (header: " + std::to_string(p.bodyBytes) +
                ") for " + std::to_string(p.info.length) + " entries of " + std::to_string(elem) + " bytes");
    }
  } else if (p.form == kFormBitmap) {
    // Raw: the body is the rest of the message, at most what `length` entries can need.
    if (p.bodySize != p.bodyBytes) {
      malformed("a bitmap-form body of " + std::to_string(p.bodySize) + " bytes (header: " +
                std::to_string(p.bodyBytes) + ")");
    }
    // The most: two bitmaps of length bits, and an ordinal and a float for every entry.
    const uint64_t length = p.info.length;
    if (p.bodyBytes > 8 + 2 * uint64_t(bitmapBytes(length)) + 8 * length) {
      malformed("a body of " + std::to_string(p.bodyBytes) + " bytes is more than " + std::to_string(p.info.length) +
                " entries can take");
    }
  } else if (p.bodyBytes > maxSparseBody(p.info.kind, p.info.length)) {
    malformed("a body of " + std::to_string(p.bodyBytes) + " bytes is more than " + std::to_string(p.info.length) +
              " entries can take");
  }
  return p;
}

// The zstd frame after the header, decompressed into exactly bodyBytes.
std::vector<uint8_t> inflate(const Parsed& p) {
  const unsigned long long declared = ZSTD_getFrameContentSize(p.body, p.bodySize);
  if (declared == ZSTD_CONTENTSIZE_ERROR || declared == ZSTD_CONTENTSIZE_UNKNOWN) {
    malformed("the body is not a zstd frame with its size");
  }
  if (declared != p.bodyBytes) {
    malformed("the zstd frame holds " + std::to_string(declared) + " bytes, the header says " +
              std::to_string(p.bodyBytes));
  }
  const size_t frame = ZSTD_findFrameCompressedSize(p.body, p.bodySize);
  if (ZSTD_isError(frame) || frame != p.bodySize) malformed("the zstd frame does not end where the message ends");
  std::vector<uint8_t> body(p.bodyBytes);
  struct DctxDeleter {
    void operator()(ZSTD_DCtx* d) const { ZSTD_freeDCtx(d); }
  };
  thread_local std::unique_ptr<ZSTD_DCtx, DctxDeleter> dctx(ZSTD_createDCtx());
  const size_t got = ZSTD_decompressDCtx(dctx.get(), body.data(), body.size(), p.body, p.bodySize);
  if (ZSTD_isError(got)) malformed(std::string("bad zstd frame: ") + ZSTD_getErrorName(got));
  if (got != p.bodyBytes) malformed("the zstd frame decompressed to fewer bytes than it declared");
  return body;
}

}  // namespace

const char* kindName(CodecKind kind) {
  switch (kind) {
    case CodecKind::None: return "none";
    case CodecKind::Fp16: return "fp16";
    case CodecKind::Bf16: return "bf16";
    case CodecKind::TopK: return "topk";
    case CodecKind::Threshold: return "threshold";
    case CodecKind::OneBit: return "onebit";
  }
  return "?";
}

// ---- spec --------------------------------------------------------------------------------------

float roundTau(double tau) {
  int exponent = 0;
  const double fraction = std::frexp(tau, &exponent);  // tau = fraction * 2^exponent, fraction in [0.5, 1)
  return float(std::ldexp(std::nearbyint(std::ldexp(fraction, 8)), exponent - 8));
}

CodecSpec CodecSpec::parse(std::string_view text) {
  auto bad = [&](const std::string& why) -> InvalidArgument {
    return InvalidArgument("--codec " + std::string(text) + ": " + why + "; accepted: " + std::string(kCodecForms));
  };
  auto number = [&](std::string_view digits) {
    const std::string s(digits);
    size_t used = 0;
    double v = 0;
    try {
      v = std::stod(s, &used);
    } catch (const std::exception&) {
      throw bad("'" + s + "' is not a number");
    }
    if (used != s.size() || !std::isfinite(v)) throw bad("'" + s + "' is not a number");
    return v;
  };
  CodecSpec spec;
  const size_t colon = text.find(':');
  const std::string_view name = text.substr(0, colon);
  const bool hasArg = colon != std::string_view::npos;
  if (name == "none" || name == "fp16" || name == "bf16" || name == "onebit") {
    if (hasArg) throw bad(std::string(name) + " takes no parameter");
    spec.kind = name == "none" ? CodecKind::None
                : name == "fp16" ? CodecKind::Fp16
                : name == "bf16" ? CodecKind::Bf16
                                 : CodecKind::OneBit;
  } else if (name == "topk") {
    if (!hasArg) throw bad("topk needs a ratio, e.g. topk:0.01");
    spec.kind = CodecKind::TopK;
    spec.ratio = number(text.substr(colon + 1));
    // The message carries the ratio as a float: one below 1e-30 (denormal, or 0) no rank decodes.
    if (!(spec.ratio >= 1e-30 && spec.ratio <= 1)) throw bad("the ratio must be in (0, 1] (at least 1e-30)");
  } else if (name == "threshold") {
    if (!hasArg) throw bad("threshold needs a tau, e.g. threshold:0.01");
    spec.kind = CodecKind::Threshold;
    const double tau = number(text.substr(colon + 1));
    if (!(tau >= 1e-30 && tau <= 1e30)) throw bad("tau must be positive (between 1e-30 and 1e30)");
    spec.tau = roundTau(tau);
  } else {
    throw bad("unknown codec '" + std::string(name) + "'");
  }
  return spec;
}

std::string CodecSpec::text() const {
  char buf[64];
  switch (kind) {
    case CodecKind::TopK: std::snprintf(buf, sizeof buf, "topk:%.17g", ratio); return buf;
    case CodecKind::Threshold: std::snprintf(buf, sizeof buf, "threshold:%.9g", double(tau)); return buf;
    default: return kindName(kind);
  }
}

// ---- decoding ----------------------------------------------------------------------------------

MessageInfo peekMessage(std::span<const uint8_t> message) { return parseHeader(message).info; }

void decodeAdd(std::span<const uint8_t> message, std::span<float> out, float scale) {
  const Parsed p = parseHeader(message);
  const uint64_t length = p.info.length;
  if (length != out.size()) {
    malformed("it holds " + std::to_string(length) + " entries for a buffer of " + std::to_string(out.size()));
  }
  switch (p.info.kind) {
    case CodecKind::None:
      for (size_t i = 0; i < length; ++i) {
        float v;
        std::memcpy(&v, p.body + 4 * i, 4);
        out[i] += scale * v;
      }
      return;
    case CodecKind::Fp16:
      convert::addHalf(p.body, out.data(), length, scale);
      return;
    case CodecKind::Bf16:
      convert::addBf16(p.body, out.data(), length, scale);
      return;
    case CodecKind::TopK:
    case CodecKind::Threshold: {
      const uint32_t param = std::bit_cast<uint32_t>(p.info.param);
      const bool signEntriesAllowed = p.info.kind == CodecKind::Threshold;
      if (p.form == kFormBitmap) {
        Reader in(p.body, p.bodySize, "the body");
        const BitmapView view = readBitmap(in, length, signEntriesAllowed);
        in.expectEnd();
        if (view.valueCount == 0) {
          // The same products as below: scale * (+-param).
          addSignEntries(view, scale * std::bit_cast<float>(param), scale * std::bit_cast<float>(param ^ 0x80000000u),
                         out.data());
          return;
        }
        view.forEach([&](uint32_t index, bool isValue, bool negative, uint32_t value) {
          const uint32_t bits = isValue ? value : param ^ (uint32_t(negative) << 31);
          out[index] += scale * std::bit_cast<float>(bits);
        });
        return;
      }
      const std::vector<uint8_t> body = inflate(p);
      Reader in(body.data(), body.size(), "the body");
      const ListView list = readList(in, length, signEntriesAllowed);
      in.expectEnd();
      // A sign entry is +-param: param's bits with the sign bit flipped, chosen without a branch.
      list.forEach([&](uint32_t index, bool isValue, bool negative, uint32_t value) {
        const uint32_t bits = isValue ? value : param ^ (uint32_t(negative) << 31);
        out[index] += scale * std::bit_cast<float>(bits);
      });
      return;
    }
    case CodecKind::OneBit: {
      const std::vector<uint8_t> body = inflate(p);
      Reader in(body.data(), body.size(), "the body");
      const float positive = in.f32();
      const float negative = in.f32();
      if (!(positive >= 0.0f && std::isfinite(positive) && negative >= 0.0f && std::isfinite(negative))) {
        malformed("onebit scales must be finite and non-negative");
      }
      const uint8_t* signs = in.take(bitmapBytes(length));
      checkPadding(signs, length, "the sign bitmap");
      const ListView escapes = readList(in, length, false);
      in.expectEnd();
      escapes.forEach([&](uint32_t index, bool, bool, uint32_t) {
        if (bitAt(signs, index)) malformed("an escaped entry has its sign bit set");
      });
      const float plus = scale * positive;
      const float minus = scale * -negative;
      size_t next = 0;  // the entries between escapes take their sign's scale
      escapes.forEach([&](uint32_t index, bool, bool, uint32_t value) {
        addOneBitSigns(signs, next, index, plus, minus, out.data());
        out[index] += scale * std::bit_cast<float>(value);
        next = index + 1;
      });
      addOneBitSigns(signs, next, length, plus, minus, out.data());
      return;
    }
  }
}

}  // namespace cohort::compress
