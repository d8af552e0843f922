// Codecs for what the schemes send: gradients, parameter changes, pushes. Torch-free, on flat
// float buffers, so they build in seconds and the fuzz targets can link them.
//
// An Encoder belongs to one flat buffer of a fixed length and keeps that buffer's error-feedback
// residual (Strom 2015; Seide et al. 2014): each encode() sends a compressed form of
// acc = input + residual and keeps residual := acc - sent, so what is not sent this step is sent
// later, never lost. The split is exact for `topk` and `threshold` (sent + residual == acc bit for
// bit, every entry, see docs/ARCHITECTURE.md "Compression"); `onebit` rounds that one subtraction
// (at most half an ulp of the residual per entry and step: +-scale cannot be split off a float
// exactly in general); `none`, `fp16` and `bf16` keep no residual.
//
// A message is self-describing (header: magic, version, codec, form, length, parameter, body size:
// topk and threshold lists go as an index list in a zstd frame or, when dense, as a raw bitmap), so
// the receiver needs no state: decodeAdd() checks it as hostile input and adds its values into a
// buffer. The layout is in docs/ARCHITECTURE.md.
#pragma once

#include <cohort/error.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace cohort::compress {

enum class CodecKind : uint8_t { None = 0, Fp16 = 1, Bf16 = 2, TopK = 3, Threshold = 4, OneBit = 5 };

// What --codec accepts; parse errors quote it.
inline constexpr std::string_view kCodecForms =
    "none, fp16, bf16, topk:RATIO (0 < RATIO <= 1), threshold:TAU (TAU > 0), onebit";

struct CodecSpec {
  CodecKind kind = CodecKind::None;
  double ratio = 1.0;  // topk: the fraction of entries sent each step
  float tau = 0.0f;    // threshold: rounded to 8 significant bits (see roundTau)

  // Parses the --codec text; throws InvalidArgument naming the accepted forms.
  static CodecSpec parse(std::string_view text);
  // The canonical text (parse(text()) == *this).
  std::string text() const;
  // none, fp16 and bf16: every entry is sent, as a dense array.
  bool dense() const { return kind == CodecKind::None || kind == CodecKind::Fp16 || kind == CodecKind::Bf16; }
  // The 16-bit dense codecs, which the allreduce strategy sums in 16 bits.
  bool sixteenBit() const { return kind == CodecKind::Fp16 || kind == CodecKind::Bf16; }
  bool errorFeedback() const { return !dense(); }
  bool operator==(const CodecSpec&) const = default;
};

// topk's k: how many of `finite` finite entries it sends, ceil(ratio * finite), at least 1 of any.
size_t topKCount(double ratio, size_t finite);

// tau with at most 8 significant bits, so that acc -+ tau is exact for tau <= |acc| < 2^16 tau.
float roundTau(double tau);

// A message that is not what it claims to be (truncated, wrong length, index out of range, ...).
class MalformedMessage : public CommError {
 public:
  using CommError::CommError;
};

// The header of a message, checked: the magic, version, codec, length within kMaxLength, and a
// body size that fits the codec and the length. Throws MalformedMessage.
struct MessageInfo {
  CodecKind kind = CodecKind::None;
  uint64_t length = 0;  // floats in the decoded buffer
  float param = 0.0f;   // topk: ratio; threshold: tau; otherwise 0
};
MessageInfo peekMessage(std::span<const uint8_t> message);
inline uint64_t decodedLength(std::span<const uint8_t> message) { return peekMessage(message).length; }

// The longest buffer a message may describe (2^31 floats, 8 GiB).
inline constexpr uint64_t kMaxLength = uint64_t(1) << 31;
inline constexpr size_t kHeaderBytes = 24;
// The largest body a header can describe (its size field has 32 bits). An Encoder refuses a length
// whose dense body (none: 4 bytes a float, fp16 and bf16: 2) would be larger, and encode() a
// sparse message that grows larger: the decoder would reject such a message.
inline constexpr uint64_t kMaxBodyBytes = UINT32_MAX;

// out[i] += scale * decoded[i]. out.size() must equal the message's length. Checks the whole
// message before it touches out: on MalformedMessage, out is unchanged. Non-finite values in a
// message are decoded as they are (an encoder sends them when its input had them).
void decodeAdd(std::span<const uint8_t> message, std::span<float> out, float scale = 1.0f);

// onebit's two scales: the mean |acc| of the finite entries of each sign (zero counts as positive).
struct OneBitScales {
  float positive = 0.0f;
  float negative = 0.0f;
};
// The scales the CPU pass computes (sums in double, entry by entry in index order) for `acc`.
OneBitScales oneBitScalesOf(std::span<const float> acc);
// The same from sums of the |acc| of each sign made in another order (a device's reduction, in
// double): the CPU pass's scales whenever the sums decide them, which is almost always (any order's
// sum of same-signed terms is within a factor 1 +- 1.01 count 2^-53 of the exact one); std::nullopt
// when only the index order can, and oneBitScalesOf must run over the entries.
std::optional<OneBitScales> oneBitScalesFromSums(double positive, uint64_t nPositive, double negative,
                                                 uint64_t nNegative);

class Encoder {
 public:
  // length: the buffer's size, at most kMaxLength (and kMaxBodyBytes / 4 for none, / 2 for fp16
  // and bf16); InvalidArgument beyond. The residual starts at zero.
  Encoder(CodecSpec spec, size_t length);
  ~Encoder();
  Encoder(Encoder&&) noexcept;
  Encoder& operator=(Encoder&&) noexcept;

  // Encodes input (+ residual) into a new message; input.size() must equal length().
  //
  // Non-finite entries (of input + residual) are sent as they are, with a residual of 0 for that
  // entry, so that one NaN does not stay in the residual for ever; fp16 saturates finite values
  // beyond its range to +-65504 (bf16 to +-3.39e38) instead of sending infinities.
  std::vector<uint8_t> encode(std::span<const float> input);
  void encode(std::span<const float> input, std::vector<uint8_t>& message);

  // topk and threshold, when a device made the pass (src/schemes/device_select.h): the message
  // encode() sends for a buffer whose acc (input + residual) selected these entries, `indices`
  // strictly increasing and below length(), `acc` their values. The residual here is not touched:
  // the device keeps it. InvalidArgument for another codec or indices out of order.
  void encodeSelected(std::span<const int64_t> indices, std::span<const float> acc, std::vector<uint8_t>& message);
  // onebit, when a device made the pass: the message encode() sends for a buffer whose acc has
  // these scales, the sign bitmap `negative` (bit i % 8 of byte i / 8 set for a finite acc[i] < 0;
  // bitmapBytes(length()) bytes) and the non-finite entries at `escapes` (strictly increasing) with
  // their values. The residual here is not touched. InvalidArgument for another codec or a
  // malformed part.
  void encodeOneBit(OneBitScales scales, std::span<const uint8_t> negative, std::span<const int64_t> escapes,
                    std::span<const float> escapeValues, std::vector<uint8_t>& message);

  std::span<const float> residual() const { return residual_; }
  // Forgets the residual (after a warm-up, or when the parameters were replaced).
  void resetResidual();
  // Puts back a residual saved from residual() (a checkpoint); InvalidArgument when its size is not
  // this encoder's residual's (0 for the codecs without one).
  void setResidual(std::span<const float> residual);
  const CodecSpec& spec() const { return spec_; }
  size_t length() const { return length_; }
  // Entries sent by the last encode (all of them for the dense codecs and onebit).
  size_t lastSent() const { return lastSent_; }

 private:
  struct Scratch;  // zstd context and buffers reused from step to step
  CodecSpec spec_;
  size_t length_;
  std::vector<float> residual_;  // empty for the codecs without error feedback
  std::unique_ptr<Scratch> scratch_;
  size_t lastSent_ = 0;
};

// How the codecs compute, process-wide. Fast, the default: AVX2 and F16C conversions where the CPU
// has them (checked at run time; scalar otherwise), one fused pass over input and residual, topk's
// selection narrowed by a sampled threshold. Reference: the plain scalar code, one step at a time,
// kept as the definition that Fast is tested against. Both give the same messages, residuals and
// decoded values, bit for bit (a NaN added to a NaN may keep either payload). The environment
// variable COHORT_CODEC_PATH=reference starts a process on Reference.
enum class CodecPath : uint8_t { Fast, Reference };
CodecPath codecPath();
void setCodecPath(CodecPath path);
// Whether Fast converts with AVX2 and F16C on this CPU.
bool vectorConversions();

// IEEE binary16 and bfloat16 conversions, round to nearest even. Finite floats beyond the target's
// range saturate to its largest finite value; infinities stay infinite, NaN stays NaN.
uint16_t floatToHalf(float value);
float halfToFloat(uint16_t bits);
uint16_t floatToBf16(float value);
float bf16ToFloat(uint16_t bits);
// The span forms follow codecPath(); out.size() must be in.size().
void floatsToHalf(std::span<const float> in, std::span<uint16_t> out);
void halfToFloats(std::span<const uint16_t> in, std::span<float> out);
void floatsToBf16(std::span<const float> in, std::span<uint16_t> out);
void bf16ToFloats(std::span<const uint16_t> in, std::span<float> out);
// One hop of a ring allreduce in 16 bits, summed in float32: acc[i] += the float of received[i],
// then rounded[i] = acc[i] in 16 bits (as floatsToHalf / floatsToBf16 round). In blocks that stay
// in cache; acc, received and rounded must have one size (received and rounded may be the same
// buffer).
void addHalfAndRound(std::span<const uint16_t> received, std::span<float> acc, std::span<uint16_t> rounded);
void addBf16AndRound(std::span<const uint16_t> received, std::span<float> acc, std::span<uint16_t> rounded);

}  // namespace cohort::compress
