// The encoders: each keeps its buffer's error-feedback residual and writes messages in the layout
// of docs/ARCHITECTURE.md ("Compression"), which also explains the residual arithmetic.
#include "compress/codec.h"

#include "compress/convert.h"
#include "compress/format.h"
#include "compress/path.h"

#include <zstd.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>

namespace cohort::compress {

namespace {

constexpr int kZstdLevel = 1;

void putU32(std::vector<uint8_t>& out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out.push_back(uint8_t(v >> (8 * i)));
}
void putU64(std::vector<uint8_t>& out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out.push_back(uint8_t(v >> (8 * i)));
}
void putF32(std::vector<uint8_t>& out, float v) { putU32(out, std::bit_cast<uint32_t>(v)); }

void putHeader(std::vector<uint8_t>& out, CodecKind kind, uint64_t length, float param, uint32_t bodyBytes) {
  out.insert(out.end(), kMagic, kMagic + 4);
  out.push_back(kVersion);
  out.push_back(uint8_t(kind));
  out.push_back(0);
  out.push_back(0);
  putU64(out, length);
  putF32(out, param);
  putU32(out, bodyBytes);
}

// A sparse list: strictly increasing indices, each either a "sign entry" (decoded as +-magnitude,
// the codec's parameter) or a "value entry" (an explicit float). Laid out as
//   u32 n | n varints: the first index, then the difference to the previous one (>= 1)
//   | value-entry bitmap | sign bitmap | the value entries' floats, in index order.
// Entries are added in index order; the varints go straight into the body, the bitmaps and floats
// wait beside it until finish() appends them.
class ListWriter {
 public:
  // Starts a list at the end of body, which must outlive the list.
  void begin(std::vector<uint8_t>& body) {
    body_ = &body;
    countAt_ = body.size();
    used_ = countAt_ + 4;
    count_ = 0;
    previous_ = 0;
    isValue_.clear();
    negative_.clear();
    values_.clear();
  }
  void addSign(size_t index, bool negative) {
    add(index);
    if (negative) negative_.back() |= uint8_t(1u << ((count_ - 1) % 8));
  }
  void addValue(size_t index, float value) {
    add(index);
    isValue_.back() |= uint8_t(1u << ((count_ - 1) % 8));
    values_.push_back(value);
  }
  size_t count() const { return count_; }
  void finish() {
    std::vector<uint8_t>& body = *body_;
    body.resize(used_);
    for (int i = 0; i < 4; ++i) body[countAt_ + size_t(i)] = uint8_t(count_ >> (8 * i));
    body.insert(body.end(), isValue_.begin(), isValue_.end());
    body.insert(body.end(), negative_.begin(), negative_.end());
    const size_t floatsAt = body.size();
    body.resize(floatsAt + 4 * values_.size());
    if (!values_.empty()) std::memcpy(body.data() + floatsAt, values_.data(), 4 * values_.size());
  }

 private:
  void add(size_t index) {
    uint32_t v = count_ == 0 ? uint32_t(index) : uint32_t(index) - previous_;
    previous_ = uint32_t(index);
    std::vector<uint8_t>& body = *body_;
    if (body.size() < used_ + 5) body.resize(std::max(2 * body.size(), used_ + 4096));
    uint8_t* p = body.data() + used_;
    while (v >= 0x80) {
      *p++ = uint8_t(v | 0x80);
      v >>= 7;
    }
    *p++ = uint8_t(v);
    used_ = size_t(p - body.data());
    if (count_ % 8 == 0) {
      isValue_.push_back(0);
      negative_.push_back(0);
    }
    ++count_;
  }

  std::vector<uint8_t>* body_ = nullptr;
  size_t countAt_ = 0;  // where the u32 n goes
  size_t used_ = 0;     // body bytes written so far
  size_t count_ = 0;
  uint32_t previous_ = 0;
  std::vector<uint8_t> isValue_;
  std::vector<uint8_t> negative_;
  std::vector<float> values_;
};

}  // namespace

struct Encoder::Scratch {
  struct CctxDeleter {
    void operator()(ZSTD_CCtx* c) const { ZSTD_freeCCtx(c); }
  };
  std::unique_ptr<ZSTD_CCtx, CctxDeleter> cctx{ZSTD_createCCtx()};
  std::vector<uint8_t> body;
  std::vector<float> magnitudes;
  ListWriter list;
};

Encoder::Encoder(CodecSpec spec, size_t length)
    : spec_(spec), length_(length), scratch_(std::make_unique<Scratch>()) {
  COHORT_CHECK(length <= kMaxLength, InvalidArgument, "a codec buffer of ", length, " floats is beyond the limit of ",
               kMaxLength);
  if (spec_.errorFeedback()) residual_.assign(length, 0.0f);
}
Encoder::~Encoder() = default;
Encoder::Encoder(Encoder&&) noexcept = default;
Encoder& Encoder::operator=(Encoder&&) noexcept = default;

void Encoder::resetResidual() { std::fill(residual_.begin(), residual_.end(), 0.0f); }

std::vector<uint8_t> Encoder::encode(std::span<const float> input) {
  std::vector<uint8_t> message;
  encode(input, message);
  return message;
}

void Encoder::encode(std::span<const float> input, std::vector<uint8_t>& message) {
  COHORT_CHECK_EQ(input.size(), length_, InvalidArgument, "the input to the ", kindName(spec_.kind),
                  " encoder has the wrong length");
  message.clear();
  const size_t n = length_;
  lastSent_ = n;
  float param = 0.0f;
  switch (spec_.kind) {
    case CodecKind::None:
      message.reserve(kHeaderBytes + 4 * n);
      putHeader(message, spec_.kind, n, 0.0f, uint32_t(4 * n));
      message.resize(kHeaderBytes + 4 * n);
      if (n > 0) std::memcpy(message.data() + kHeaderBytes, input.data(), 4 * n);
      return;
    case CodecKind::Fp16:
    case CodecKind::Bf16: {
      putHeader(message, spec_.kind, n, 0.0f, uint32_t(2 * n));
      message.resize(kHeaderBytes + 2 * n);
      uint8_t* out = message.data() + kHeaderBytes;
      if (spec_.kind == CodecKind::Fp16) {
        convert::toHalf(input.data(), out, n);
      } else {
        convert::toBf16(input.data(), out, n);
      }
      return;
    }
    default: break;
  }

  // Error feedback: the residual becomes acc = input + residual, and then acc - sent.
  float* acc = residual_.data();
  for (size_t i = 0; i < n; ++i) acc[i] += input[i];
  std::vector<uint8_t>& body = scratch_->body;
  body.clear();
  ListWriter& list = scratch_->list;

  if (spec_.kind == CodecKind::TopK) {
    param = float(spec_.ratio);
    // The k largest finite |acc| are sent as they are (residual 0: exact); non-finite entries too.
    std::vector<float>& mags = scratch_->magnitudes;
    mags.clear();
    for (size_t i = 0; i < n; ++i) {
      if (std::isfinite(acc[i])) mags.push_back(std::fabs(acc[i]));
    }
    const size_t finite = mags.size();
    const size_t k = finite == 0 ? 0 : std::clamp<size_t>(size_t(std::ceil(spec_.ratio * double(finite))), 1, finite);
    float kth = 0.0f;
    if (k > 0 && k < finite) {
      std::nth_element(mags.begin(), mags.begin() + (finite - k), mags.end());
      kth = mags[finite - k];
    }
    size_t above = 0;  // entries strictly above kth are all sent; ties fill up to k in index order
    for (size_t i = 0; i < n; ++i) {
      if (std::isfinite(acc[i]) && std::fabs(acc[i]) > kth) ++above;
    }
    size_t ties = k > above ? k - above : 0;
    list.begin(body);
    for (size_t i = 0; i < n; ++i) {
      const float a = acc[i];
      const float m = std::fabs(a);
      bool send = !std::isfinite(a) || m > kth;
      if (!send && m == kth && m > 0.0f && ties > 0) {
        send = true;
        --ties;
      }
      if (send) {
        list.addValue(i, a);
        acc[i] = 0.0f;
      }
    }
    list.finish();
    lastSent_ = list.count();
  } else if (spec_.kind == CodecKind::Threshold) {
    const float tau = spec_.tau;
    param = tau;
    // tau has at most 8 significant bits, tau = m * 2^q with m < 2^8, so for tau <= |acc| < 2^16 tau
    // both acc and tau are multiples of ulp(acc) and acc -+ tau (smaller than |acc|) is exact: a
    // sign entry. Beyond that, r = fl(acc -+ tau) lies within a factor 2 of acc, so acc - r is
    // exact (Sterbenz) and is sent as a value entry: +-tau up to acc's rounding, so that the step
    // stays as small as Strom's however large the residual has grown. Only when tau is below
    // half an ulp of acc (|acc| > 2^24 tau, r == acc) is acc sent whole; non-finite acc too.
    const float limit = tau * 65536.0f;
    list.begin(body);
    for (size_t i = 0; i < n; ++i) {
      const float a = acc[i];
      const float m = std::fabs(a);
      if (!(m >= tau)) {
        if (!std::isfinite(a)) {  // NaN
          list.addValue(i, a);
          acc[i] = 0.0f;
        }
        continue;
      }
      const float r = a < 0.0f ? a + tau : a - tau;
      if (m < limit) {
        list.addSign(i, a < 0.0f);
        acc[i] = r;
      } else if (std::isfinite(a) && r != a) {
        list.addValue(i, a - r);
        acc[i] = r;
      } else {
        list.addValue(i, a);
        acc[i] = 0.0f;
      }
    }
    list.finish();
    lastSent_ = list.count();
  } else {  // OneBit
    // One scale per sign, the mean |acc| of the entries of that sign; zero counts as positive.
    double sumPos = 0, sumNeg = 0;
    size_t nPos = 0, nNeg = 0;
    for (size_t i = 0; i < n; ++i) {
      const float a = acc[i];
      if (!std::isfinite(a)) continue;
      if (a < 0.0f) {
        sumNeg -= a;
        ++nNeg;
      } else {
        sumPos += a;
        ++nPos;
      }
    }
    const float positive = nPos ? float(sumPos / double(nPos)) : 0.0f;
    const float negative = nNeg ? float(sumNeg / double(nNeg)) : 0.0f;
    // The means of finite floats are finite floats.
    putF32(body, positive);
    putF32(body, negative);
    const size_t bitmapAt = body.size();
    body.resize(bitmapAt + bitmapBytes(n), 0);
    list.begin(body);
    for (size_t i = 0; i < n; ++i) {
      const float a = acc[i];
      if (!std::isfinite(a)) {
        list.addValue(i, a);
        acc[i] = 0.0f;
      } else if (a < 0.0f) {
        body[bitmapAt + i / 8] |= uint8_t(1u << (i % 8));
        acc[i] = a + negative;
      } else {
        acc[i] = a - positive;
      }
    }
    list.finish();
  }

  COHORT_CHECK(body.size() <= std::numeric_limits<uint32_t>::max(), InvalidArgument, "a ", kindName(spec_.kind),
               " message body of ", body.size(), " bytes is too large; use a smaller buffer");
  const size_t bound = ZSTD_compressBound(body.size());
  putHeader(message, spec_.kind, n, param, uint32_t(body.size()));
  message.resize(kHeaderBytes + bound);
  const size_t got = ZSTD_compressCCtx(scratch_->cctx.get(), message.data() + kHeaderBytes, bound, body.data(),
                                       body.size(), kZstdLevel);
  COHORT_CHECK(!ZSTD_isError(got), InvalidArgument, "zstd failed to compress a codec message: ",
               ZSTD_getErrorName(got));
  message.resize(kHeaderBytes + got);
}

}  // namespace cohort::compress
