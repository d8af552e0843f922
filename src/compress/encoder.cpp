// Encoder: the dense codecs (none, fp16, bf16) here; the error-feedback codecs' passes in the
// files compress/encoder_internal.h lists, each keeping its buffer's residual; then the choice of
// a sparse list's form, the header and zstd. Messages are laid out as docs/ARCHITECTURE.md
// ("Compression") says, which also explains the residual arithmetic.
#include "compress/codec.h"

#include "base/coding.h"
#include "compress/convert.h"
#include "compress/encoder_internal.h"
#include "compress/format.h"
#include "compress/path.h"

#include <zstd.h>

#include <algorithm>
#include <cstring>
#include <limits>

namespace cohort::compress {

// acc[i] = residual[i] + input[i], in place.
void accumulate(std::span<const float> input, float* residual) {
  for (size_t i = 0; i < input.size(); ++i) residual[i] += input[i];
}

namespace {

constexpr int kZstdLevel = 1;

void putHeader(std::vector<uint8_t>& out, CodecKind kind, uint64_t length, float param, uint32_t bodyBytes,
               uint8_t form = kFormList) {
  out.insert(out.end(), kMagic, kMagic + 4);
  out.push_back(kVersion);
  out.push_back(uint8_t(kind));
  out.push_back(form);
  out.push_back(0);
  putFixed64(out, length);
  putFloat32(out, param);
  putFixed32(out, bodyBytes);
}

}  // namespace

struct Encoder::Scratch {
  struct CctxDeleter {
    void operator()(ZSTD_CCtx* c) const { ZSTD_freeCCtx(c); }
  };
  std::unique_ptr<ZSTD_CCtx, CctxDeleter> cctx{ZSTD_createCCtx()};
  std::vector<uint8_t> body;
  std::vector<uint8_t> otherForm;  // the body rewritten in the other form
  TopKScratch topk;
  ListWriter list;
  BitmapWriter bitmap;
};

Encoder::Encoder(CodecSpec spec, size_t length)
    : spec_(spec), length_(length), scratch_(std::make_unique<Scratch>()) {
  COHORT_CHECK(length <= kMaxLength, InvalidArgument, "a codec buffer of ", length, " floats is beyond the limit of ",
               kMaxLength);
  // The header's body size is 32 bits: a dense body must fit (the sparse ones are checked as
  // they are made, in encode()).
  const uint64_t denseBytes = spec_.kind == CodecKind::None                                   ? 4
                              : spec_.kind == CodecKind::Fp16 || spec_.kind == CodecKind::Bf16 ? 2
                                                                                               : 0;
  COHORT_CHECK(denseBytes * length <= kMaxBodyBytes, InvalidArgument, "--codec ", kindName(spec_.kind), ": a buffer of ",
               length, " floats makes a message body of ", denseBytes * length, " bytes, beyond the format's ",
               kMaxBodyBytes, ": split it (smaller buckets, more shards)");
  if (spec_.errorFeedback()) residual_.assign(length, 0.0f);
}
Encoder::~Encoder() = default;
Encoder::Encoder(Encoder&&) noexcept = default;
Encoder& Encoder::operator=(Encoder&&) noexcept = default;

void Encoder::resetResidual() { std::fill(residual_.begin(), residual_.end(), 0.0f); }

void Encoder::setResidual(std::span<const float> residual) {
  COHORT_CHECK(residual.size() == residual_.size(), InvalidArgument, "--codec ", kindName(spec_.kind), ": a saved residual of ",
               residual.size(), " floats cannot be put back into an encoder whose residual has ", residual_.size(),
               ": restore the residual saved with this model and codec");
  std::copy(residual.begin(), residual.end(), residual_.begin());
}

std::vector<uint8_t> Encoder::encode(std::span<const float> input) {
  std::vector<uint8_t> message;
  encode(input, message);
  return message;
}

namespace {

// none, fp16 and bf16: the whole buffer, with no residual. False for the other codecs.
bool encodeDense(CodecKind kind, std::span<const float> input, std::vector<uint8_t>& message) {
  const size_t n = input.size();
  switch (kind) {
    case CodecKind::None:
      message.reserve(kHeaderBytes + 4 * n);
      putHeader(message, kind, n, 0.0f, uint32_t(4 * n));
      message.resize(kHeaderBytes + 4 * n);
      if (n > 0) std::memcpy(message.data() + kHeaderBytes, input.data(), 4 * n);
      return true;
    case CodecKind::Fp16:
    case CodecKind::Bf16: {
      putHeader(message, kind, n, 0.0f, uint32_t(2 * n));
      message.resize(kHeaderBytes + 2 * n);
      uint8_t* out = message.data() + kHeaderBytes;
      if (kind == CodecKind::Fp16) {
        convert::toHalf(input.data(), out, n);
      } else {
        convert::toBf16(input.data(), out, n);
      }
      return true;
    }
    default: return false;
  }
}

// topk and threshold: the pass wrote one form of the list (the bitmap form on threshold's AVX2
// path, the list form elsewhere); the other is made from it when it is the one to send. Returns
// the form body now holds.
uint8_t chooseForm(size_t n, const SparsePass& pass, std::vector<uint8_t>& body, std::vector<uint8_t>& other,
                   ListWriter& list, BitmapWriter& bitmap) {
  const bool sendBitmap = bitmapFormPays(n, pass.count, pass.values);
  if (sendBitmap != pass.wroteBitmap) {
    if (sendBitmap) {
      listToBitmap(body, n, bitmap, other);
    } else {
      bitmapToList(body, n, list, other);
    }
    body.swap(other);
  }
  return sendBitmap ? kFormBitmap : kFormList;
}

// The header and the body: raw in the bitmap form, through zstd in the list form.
void finishMessage(CodecKind kind, size_t n, float param, uint8_t form, const std::vector<uint8_t>& body,
                   ZSTD_CCtx* cctx, std::vector<uint8_t>& message) {
  COHORT_CHECK(body.size() <= std::numeric_limits<uint32_t>::max(), InvalidArgument, "a ", kindName(kind),
               " message body of ", body.size(), " bytes is too large; use a smaller buffer");
  const size_t bound = ZSTD_compressBound(body.size());
  COHORT_CHECK(body.size() <= kMaxBodyBytes, InvalidArgument, "--codec ", kindName(kind), ": a message body of ",
               body.size(), " bytes is beyond the format's ", kMaxBodyBytes, ": split the buffer of ", n,
               " floats (smaller buckets, more shards)");
  if (form == kFormBitmap) {
    // Raw: zstd finds next to nothing in random bitmaps (docs/BENCHMARKS.md).
    message.reserve(kHeaderBytes + body.size());
    putHeader(message, kind, n, param, uint32_t(body.size()), kFormBitmap);
    message.insert(message.end(), body.begin(), body.end());
    return;
  }
  putHeader(message, kind, n, param, uint32_t(body.size()));
  message.resize(kHeaderBytes + bound);
  const size_t got =
      ZSTD_compressCCtx(cctx, message.data() + kHeaderBytes, bound, body.data(), body.size(), kZstdLevel);
  COHORT_CHECK(!ZSTD_isError(got), InvalidArgument, "zstd failed to compress a codec message: ",
               ZSTD_getErrorName(got));
  message.resize(kHeaderBytes + got);
}

// An index of a list a device pass handed in: above the previous one and inside the buffer.
void checkNextIndex(int64_t i, int64_t& previous, size_t length, const char* what) {
  COHORT_CHECK(i > previous && uint64_t(i) < length, InvalidArgument, what, " ", i, " after ", previous,
               " in a buffer of ", length, ": indices must increase and stay inside the buffer");
  previous = i;
}

}  // namespace

void Encoder::encode(std::span<const float> input, std::vector<uint8_t>& message) {
  COHORT_CHECK_EQ(input.size(), length_, InvalidArgument, "the input to the ", kindName(spec_.kind),
                  " encoder has the wrong length");
  message.clear();
  const size_t n = length_;
  lastSent_ = n;
  if (encodeDense(spec_.kind, input, message)) return;

  // Error feedback: the residual becomes acc = input + residual, and then acc - sent. The Fast
  // path adds input in the same pass that reads acc (threshold, topk) or sums it (onebit).
  float* acc = residual_.data();
  const bool fused = codecPath() == CodecPath::Fast;
  if (!fused) accumulate(input, acc);
  Scratch& s = *scratch_;
  s.body.clear();
  float param = 0.0f;
  uint8_t form = kFormList;
  if (spec_.kind == CodecKind::TopK || spec_.kind == CodecKind::Threshold) {
    const bool topk = spec_.kind == CodecKind::TopK;
    param = topk ? float(spec_.ratio) : spec_.tau;
    const SparsePass pass = topk ? encodeTopKPass(input, acc, spec_.ratio, fused, s.topk, s.list, s.body)
                                 : encodeThresholdPass(input, acc, spec_.tau, fused, s.list, s.bitmap, s.body);
    lastSent_ = pass.count;
    form = chooseForm(n, pass, s.body, s.otherForm, s.list, s.bitmap);
  } else {  // OneBit
    encodeOneBitPass(input, acc, fused, s.list, s.body);
  }
  finishMessage(spec_.kind, n, param, form, s.body, s.cctx.get(), message);
}

void Encoder::encodeSelected(std::span<const int64_t> indices, std::span<const float> acc,
                             std::vector<uint8_t>& message) {
  const bool topk = spec_.kind == CodecKind::TopK;
  COHORT_CHECK(topk || spec_.kind == CodecKind::Threshold, InvalidArgument, "--codec ", kindName(spec_.kind),
               ": only topk and threshold select their entries on a device");
  COHORT_CHECK_EQ(indices.size(), acc.size(), InvalidArgument, "a selection's indices and values differ in number");
  message.clear();
  Scratch& s = *scratch_;
  s.body.clear();
  Cursor c = s.list.reserve(s.list.begin(s.body), indices.size());
  int64_t previous = -1;
  for (size_t j = 0; j < indices.size(); ++j) {
    const int64_t i = indices[j];
    checkNextIndex(i, previous, length_, "selected index");
    const ThresholdEntry e = topk ? ThresholdEntry{true, acc[j], 0.0f} : thresholdEntry(acc[j], spec_.tau);
    if (e.isValue) {
      s.list.addValue(c, size_t(i), e.value);
    } else {
      s.list.addSign(c, size_t(i), acc[j] < 0.0f);
    }
  }
  const SparsePass pass{indices.size(), s.list.values(), /*wroteBitmap=*/false};
  s.list.finish(c);
  lastSent_ = pass.count;
  const uint8_t form = chooseForm(length_, pass, s.body, s.otherForm, s.list, s.bitmap);
  finishMessage(spec_.kind, length_, topk ? float(spec_.ratio) : spec_.tau, form, s.body, s.cctx.get(), message);
}

void Encoder::encodeOneBit(OneBitScales scales, std::span<const uint8_t> negative, std::span<const int64_t> escapes,
                           std::span<const float> escapeValues, std::vector<uint8_t>& message) {
  COHORT_CHECK(spec_.kind == CodecKind::OneBit, InvalidArgument, "--codec ", kindName(spec_.kind),
               ": only onebit encodes a sign bitmap");
  COHORT_CHECK_EQ(negative.size(), bitmapBytes(length_), InvalidArgument, "onebit's sign bitmap of ", length_,
                  " floats");
  COHORT_CHECK_EQ(escapes.size(), escapeValues.size(), InvalidArgument,
                  "onebit's non-finite entries: indices and values differ in number");
  message.clear();
  lastSent_ = length_;
  Scratch& s = *scratch_;
  s.body.clear();
  putFloat32(s.body, scales.positive);
  putFloat32(s.body, scales.negative);
  s.body.insert(s.body.end(), negative.begin(), negative.end());
  Cursor c = s.list.reserve(s.list.begin(s.body), escapes.size());
  int64_t previous = -1;
  for (size_t j = 0; j < escapes.size(); ++j) {
    const int64_t i = escapes[j];
    checkNextIndex(i, previous, length_, "non-finite entry");
    s.list.addValue(c, size_t(i), escapeValues[j]);
  }
  s.list.finish(c);
  finishMessage(spec_.kind, length_, 0.0f, kFormList, s.body, s.cctx.get(), message);
}

}  // namespace cohort::compress
