// The codecs on their own (src/compress): round trips, exact residual bookkeeping, edge values,
// and every kind of malformed message. Torch-free: the binary builds in seconds.
#include "compress/codec.h"
#include "compress/path.h"

#include <gtest/gtest.h>
#include <zstd.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <limits>
#include <random>
#include <span>
#include <tuple>
#include <vector>

namespace {

using namespace cohort::compress;
using cohort::InvalidArgument;

std::vector<float> gaussian(size_t n, uint32_t seed, float sigma = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, sigma);
  std::vector<float> v(n);
  for (auto& x : v) x = dist(rng);
  return v;
}

std::vector<float> decode(const std::vector<uint8_t>& message, size_t n) {
  std::vector<float> out(n, 0.0f);
  decodeAdd(message, out);
  return out;
}

bool sameBits(float a, float b) { return std::bit_cast<uint32_t>(a) == std::bit_cast<uint32_t>(b); }

const char* kAll[] = {"none", "fp16", "bf16", "topk:0.1", "threshold:0.5", "onebit"};
const char* kFeedback[] = {"topk:0.1", "topk:1", "threshold:0.5", "threshold:0.01", "onebit"};

TEST(CodecSpec, ParsesEveryForm) {
  EXPECT_EQ(CodecSpec::parse("none").kind, CodecKind::None);
  EXPECT_EQ(CodecSpec::parse("fp16").kind, CodecKind::Fp16);
  EXPECT_EQ(CodecSpec::parse("bf16").kind, CodecKind::Bf16);
  EXPECT_EQ(CodecSpec::parse("onebit").kind, CodecKind::OneBit);
  const CodecSpec topk = CodecSpec::parse("topk:0.01");
  EXPECT_EQ(topk.kind, CodecKind::TopK);
  EXPECT_DOUBLE_EQ(topk.ratio, 0.01);
  EXPECT_EQ(CodecSpec::parse("topk:1").ratio, 1.0);
  const CodecSpec threshold = CodecSpec::parse("threshold:0.01");
  EXPECT_EQ(threshold.kind, CodecKind::Threshold);
  EXPECT_NEAR(threshold.tau, 0.01f, 0.01f / 256);
  EXPECT_EQ(threshold.tau, 164 * 0x1p-14f);  // 8 significant bits
  for (const char* text : kAll) EXPECT_EQ(CodecSpec::parse(CodecSpec::parse(text).text()), CodecSpec::parse(text));
}

// A ratio whose float is 0 (1e-46) or denormal parsed and encoded, and no rank decoded it.
TEST(CodecSpec, TheSmallestTopkRatioEncodesWhatDecodes) {
  Encoder enc(CodecSpec::parse("topk:1e-30"), 1000);
  std::vector<float> grad(1000, 1.0f);
  grad[7] = 5.0f;
  const auto sent = decode(enc.encode(grad), 1000);
  EXPECT_EQ(sent[7], 5.0f);  // one entry: the largest
  EXPECT_EQ(enc.lastSent(), 1u);
}

TEST(CodecSpec, RejectsBadTextNamingTheForms) {
  for (const char* text :
       {"", "zip", "fp16:2", "topk", "topk:0", "topk:1e-46", "topk:1e-300", "topk:1.5", "topk:-0.1", "topk:abc",
        "topk:0.1x", "threshold", "threshold:0", "threshold:-1", "threshold:nan", "threshold:inf", "onebit:3"}) {
    try {
      CodecSpec::parse(text);
      ADD_FAILURE() << "'" << text << "' was accepted";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("accepted: none, fp16, bf16, topk:RATIO"), std::string::npos) << e.what();
    }
  }
}

TEST(Codec, RoundTrips) {
  const auto input = gaussian(1000, 1);
  for (const char* text : kAll) {
    SCOPED_TRACE(text);
    Encoder enc(CodecSpec::parse(text), input.size());
    const auto message = enc.encode(input);
    const MessageInfo info = peekMessage(message);
    EXPECT_EQ(info.length, input.size());
    EXPECT_EQ(info.kind, enc.spec().kind);
    EXPECT_EQ(decodedLength(message), input.size());
    const auto out = decode(message, input.size());
    for (size_t i = 0; i < input.size(); ++i) {
      const float got = out[i];
      // What was not sent is in the residual.
      const float sent = enc.spec().errorFeedback() ? input[i] - enc.residual()[i] : input[i];
      switch (enc.spec().kind) {
        case CodecKind::None: ASSERT_TRUE(sameBits(got, input[i])); break;
        case CodecKind::Fp16: ASSERT_NEAR(got, input[i], std::fabs(input[i]) * 0x1p-11f + 0x1p-25f); break;
        case CodecKind::Bf16: ASSERT_NEAR(got, input[i], std::fabs(input[i]) * 0x1p-8f); break;
        default: ASSERT_NEAR(got, sent, 1e-6f) << i;
      }
    }
  }
}

TEST(Codec, ScaledDecodeAddsIntoTheBuffer) {
  const auto input = gaussian(300, 2);
  for (const char* text : kAll) {
    SCOPED_TRACE(text);
    Encoder enc(CodecSpec::parse(text), input.size());
    const auto message = enc.encode(input);
    const auto once = decode(message, input.size());
    std::vector<float> out(input.size(), 1.0f);
    decodeAdd(message, out, 0.5f);
    for (size_t i = 0; i < out.size(); ++i) ASSERT_FLOAT_EQ(out[i], 1.0f + 0.5f * once[i]);
  }
}

// sent + residual == acc bit for bit, every entry, every step, for the codecs that promise it;
// onebit's one rounding stays within half an ulp of the residual.
TEST(Codec, ResidualBookkeepingIsExact) {
  const size_t n = 5000;
  for (const char* text : kFeedback) {
    SCOPED_TRACE(text);
    Encoder enc(CodecSpec::parse(text), n);
    std::vector<float> residual(n, 0.0f);
    double totalIn = 0, totalOut = 0;
    for (int step = 0; step < 30; ++step) {
      // Mixed scales, so that |acc| often passes 2 tau and the Sterbenz range.
      auto input = gaussian(n, 100 + step, step % 3 == 0 ? 10.0f : 0.05f);
      const auto message = enc.encode(input);
      const auto sent = decode(message, n);
      for (size_t i = 0; i < n; ++i) {
        const float acc = residual[i] + input[i];
        if (enc.spec().kind == CodecKind::OneBit) {
          const double exact = double(acc) - double(sent[i]);
          ASSERT_LE(std::fabs(exact - double(enc.residual()[i])),
                    0.5 * std::fabs(std::nextafter(enc.residual()[i], INFINITY) - enc.residual()[i]))
              << "entry " << i;
        } else {
          // The subtraction the other way round must give back exactly what was sent.
          ASSERT_TRUE(sameBits(acc - enc.residual()[i], sent[i]) || (sent[i] == 0 && enc.residual()[i] == acc))
              << "step " << step << " entry " << i << ": acc " << acc << " sent " << sent[i] << " residual "
              << enc.residual()[i];
          ASSERT_EQ(double(sent[i]) + double(enc.residual()[i]), double(acc));
        }
        residual[i] = enc.residual()[i];
        totalIn += input[i];
        totalOut += sent[i];
      }
    }
    double left = 0;
    for (float r : residual) left += r;
    EXPECT_NEAR(totalOut + left, totalIn, 1e-3 * n);
  }
}

TEST(Codec, ThresholdSendsPlusMinusTauAndKeepsTheRest) {
  Encoder enc(CodecSpec::parse("threshold:0.5"), 6);
  const std::vector<float> input{0.2f, 0.6f, -0.7f, 0.49f, -0.1f, 1.4f};
  const auto sent = decode(enc.encode(input), 6);
  EXPECT_EQ(sent, (std::vector<float>{0, 0.5f, -0.5f, 0, 0, 0.5f}));
  EXPECT_EQ(enc.lastSent(), 3u);
  const std::vector<float> residual(enc.residual().begin(), enc.residual().end());
  EXPECT_FLOAT_EQ(residual[5], 0.9f);
  // The residual carries over: 0.2 + 0.4 passes tau on the next step.
  const auto sent2 = decode(enc.encode(std::vector<float>{0.4f, 0, 0, 0, 0, 0}), 6);
  EXPECT_EQ(sent2[0], 0.5f);
  EXPECT_EQ(sent2[5], 0.5f);  // 0.9 still above tau
}

// A residual far above tau (beyond 2^16 tau, where +-tau is no longer a sign entry) still drains
// by about tau per step, exactly, instead of all at once.
TEST(Codec, ThresholdSendsAboutTauFromALargeResidual) {
  for (float tau : {0.5f, roundTau(0.003), roundTau(0.0123)}) {
    SCOPED_TRACE(tau);
    Encoder enc(CodecSpec{.kind = CodecKind::Threshold, .tau = tau}, 2);
    const std::vector<float> input{tau * 100000.0f, -tau * 3e6f};
    const auto sent = decode(enc.encode(input), 2);
    for (size_t i = 0; i < 2; ++i) {
      EXPECT_NEAR(std::fabs(sent[i]), tau, tau * 0.5f) << i;
      EXPECT_EQ(double(sent[i]) + double(enc.residual()[i]), double(input[i])) << i;
    }
    EXPECT_GT(sent[0], 0.0f);
    EXPECT_LT(sent[1], 0.0f);
  }
}

TEST(Codec, TopKSendsTheLargest) {
  Encoder enc(CodecSpec::parse("topk:0.25"), 8);
  const std::vector<float> input{0.1f, -5, 0.2f, 3, 0, 0.3f, -0.4f, 0.05f};
  const auto sent = decode(enc.encode(input), 8);
  EXPECT_EQ(sent, (std::vector<float>{0, -5, 0, 3, 0, 0, 0, 0}));
  EXPECT_EQ(enc.lastSent(), 2u);
}

TEST(Codec, OneBitSendsSignsWithMeanScales) {
  Encoder enc(CodecSpec::parse("onebit"), 4);
  const auto sent = decode(enc.encode(std::vector<float>{1, 3, -2, -4}), 4);
  EXPECT_EQ(sent, (std::vector<float>{2, 2, -3, -3}));
  EXPECT_EQ(std::vector<float>(enc.residual().begin(), enc.residual().end()), (std::vector<float>{-1, 1, 1, -1}));
}

TEST(Codec, EmptyAndAllZeroBuffers) {
  for (const char* text : kAll) {
    SCOPED_TRACE(text);
    Encoder empty(CodecSpec::parse(text), 0);
    const auto m0 = empty.encode(std::vector<float>{});
    EXPECT_EQ(decodedLength(m0), 0u);
    std::vector<float> none;
    decodeAdd(m0, none);

    Encoder enc(CodecSpec::parse(text), 1000);
    const std::vector<float> zeros(1000, 0.0f);
    const auto m = enc.encode(zeros);
    EXPECT_EQ(decode(m, 1000), zeros);
    if (enc.spec().errorFeedback()) {
      for (float r : enc.residual()) ASSERT_EQ(r, 0.0f);
      if (enc.spec().kind != CodecKind::OneBit) {
        EXPECT_EQ(enc.lastSent(), 0u);
      }
    }
    if (!enc.spec().dense()) {
      EXPECT_LT(m.size(), 200u) << "an all-zero sparse message should be tiny";
    }
  }
}

// The header's body size has 32 bits: a dense buffer whose body would not fit is refused when the
// encoder is made (the old encoder wrote a wrapped size its own decoder rejected), without
// allocating anything. The largest that fits is accepted.
TEST(Codec, ABufferWhoseBodyOverflowsTheHeaderIsRefused) {
  const uint64_t noneLimit = kMaxBodyBytes / 4;  // 2^30 - 1 floats
  const uint64_t halfLimit = kMaxBodyBytes / 2;  // 2^31 - 1 floats
  EXPECT_NO_THROW(Encoder(CodecSpec::parse("none"), noneLimit));
  EXPECT_NO_THROW(Encoder(CodecSpec::parse("fp16"), halfLimit));
  EXPECT_NO_THROW(Encoder(CodecSpec::parse("bf16"), halfLimit));
  for (const auto& [codec, length] : {std::pair{"none", noneLimit + 1}, std::pair{"none", kMaxLength},
                                      std::pair{"fp16", halfLimit + 1}, std::pair{"bf16", kMaxLength}}) {
    SCOPED_TRACE(codec);
    try {
      Encoder encoder(CodecSpec::parse(codec), length);
      ADD_FAILURE() << "an encoder of " << length << " floats was made";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("beyond the format's 4294967295"), std::string::npos) << e.what();
    }
  }
}

// Huge finite values stay finite and exact; +-inf and NaN are sent as they are and leave no
// residual behind.
TEST(Codec, HugeAndNonFiniteValues) {
  const float big = std::numeric_limits<float>::max();
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const std::vector<float> input{big, -big, 1e30f, inf, -inf, nan, 0.75f, -1e-30f};
  for (const char* text : kFeedback) {
    SCOPED_TRACE(text);
    Encoder enc(CodecSpec::parse(text), input.size());
    const auto sent = decode(enc.encode(input), input.size());
    EXPECT_EQ(sent[3], inf);
    EXPECT_EQ(sent[4], -inf);
    EXPECT_TRUE(std::isnan(sent[5]));
    for (size_t i = 3; i < 6; ++i) EXPECT_EQ(enc.residual()[i], 0.0f);
    for (float r : enc.residual()) EXPECT_TRUE(std::isfinite(r));
    if (enc.spec().kind == CodecKind::Threshold) {
      // Beyond 2^24 tau, tau cannot be taken off acc: sent whole, exactly.
      EXPECT_EQ(sent[0], big);
      EXPECT_EQ(sent[1], -big);
      EXPECT_EQ(sent[2], 1e30f);
    }
  }
  for (const char* text : {"fp16", "bf16"}) {
    SCOPED_TRACE(text);
    Encoder enc(CodecSpec::parse(text), input.size());
    const auto sent = decode(enc.encode(input), input.size());
    EXPECT_TRUE(std::isfinite(sent[0]) && sent[0] > 0);
    EXPECT_TRUE(std::isfinite(sent[1]) && sent[1] < 0);
    EXPECT_EQ(sent[3], inf);
    EXPECT_EQ(sent[4], -inf);
    EXPECT_TRUE(std::isnan(sent[5]));
    EXPECT_EQ(sent[6], 0.75f);
  }
}

TEST(Codec, HalfConversionSaturatesAndRoundsToNearestEven) {
  EXPECT_EQ(halfToFloat(floatToHalf(65504.0f)), 65504.0f);
  EXPECT_EQ(halfToFloat(floatToHalf(65519.0f)), 65504.0f);
  EXPECT_EQ(halfToFloat(floatToHalf(65520.0f)), 65504.0f);  // IEEE would round to infinity
  EXPECT_EQ(halfToFloat(floatToHalf(1e10f)), 65504.0f);
  EXPECT_EQ(halfToFloat(floatToHalf(-1e10f)), -65504.0f);
  EXPECT_EQ(halfToFloat(floatToHalf(1.0f + 0x1p-11f)), 1.0f);                     // tie to even
  EXPECT_EQ(halfToFloat(floatToHalf(1.0f + 3 * 0x1p-11f)), 1.0f + 0x1p-9f);       // tie to even
  EXPECT_EQ(halfToFloat(floatToHalf(0x1p-24f)), 0x1p-24f);                        // smallest subnormal
  EXPECT_EQ(halfToFloat(floatToHalf(0x1p-26f)), 0.0f);
  EXPECT_EQ(halfToFloat(floatToHalf(-0.0f)), 0.0f);
  EXPECT_TRUE(std::signbit(halfToFloat(floatToHalf(-0.0f))));
  // Every half value survives float -> half -> float.
  for (uint32_t bits = 0; bits < 0x10000; ++bits) {
    const float f = halfToFloat(uint16_t(bits));
    if (std::isnan(f)) continue;
    ASSERT_EQ(floatToHalf(f), bits) << bits;
  }
  // Rounding is to the nearest half, checked against the neighbours.
  for (float f : gaussian(20000, 7, 100.0f)) {
    const float h = halfToFloat(floatToHalf(f));
    const uint16_t b = floatToHalf(f);
    ASSERT_LE(std::fabs(h - f), std::fabs(halfToFloat(uint16_t(b + 1)) - f));
    if ((b & 0x7fff) != 0) {
      ASSERT_LE(std::fabs(h - f), std::fabs(halfToFloat(uint16_t(b - 1)) - f));
    }
  }
  // The subnormal range against a reference rounding in double.
  std::mt19937 rng(11);
  std::uniform_real_distribution<double> exponent(-30.0, -14.0);
  for (int i = 0; i < 100000; ++i) {
    const float f = float(std::exp2(exponent(rng)));
    const double steps = double(f) * 16777216.0;  // exact
    const double want = std::nearbyint(steps);      // ties to even in the default rounding mode
    ASSERT_EQ(double(halfToFloat(floatToHalf(f))), want * 0x1p-24) << f;
    ASSERT_EQ(double(halfToFloat(floatToHalf(-f))), -want * 0x1p-24) << f;
  }
  for (uint32_t k = 0; k <= 1024; ++k) {  // every tie between two subnormal steps
    const float tie = (float(k) + 0.5f) * 0x1p-24f;
    ASSERT_EQ(floatToHalf(tie), (k % 2 == 0) ? k : k + 1) << k;
  }
  EXPECT_EQ(bf16ToFloat(floatToBf16(std::numeric_limits<float>::max())), 0x1.fep127f);
  EXPECT_EQ(bf16ToFloat(floatToBf16(1.0f + 0x1p-8f)), 1.0f);  // tie to even
  EXPECT_EQ(bf16ToFloat(floatToBf16(3.0f)), 3.0f);
}

// ---- the Fast path against the Reference path ------------------------------------------------

// Runs f with the codecs on `path`, then puts back the path that was set (so that the whole suite
// can also run under COHORT_CODEC_PATH=reference).
template <typename F>
auto onPath(CodecPath path, F&& f) {
  struct Restore {
    CodecPath before = codecPath();
    ~Restore() { setCodecPath(before); }
  } restore;
  setCodecPath(path);
  return f();
}

// What COHORT_CODEC_PATH selects; run in every run of the suite (where the variable is usually
// unset: Fast), and in child processes by TheEnvironmentChoosesThePath.
TEST(CodecPaths, PathFromTheEnvironment) {
  const char* value = std::getenv("COHORT_CODEC_PATH");
  const std::string text = value ? value : "fast";
  if (text == "fast" || text == "reference") {
    EXPECT_EQ(codecPath(), text == "fast" ? CodecPath::Fast : CodecPath::Reference);
  } else {
    EXPECT_THROW(codecPath(), InvalidArgument);
  }
}

TEST(CodecPaths, TheEnvironmentChoosesThePath) {
  const std::string self = std::filesystem::read_symlink("/proc/self/exe");
  for (const char* value : {"reference", "fast", "scalar"}) {
    const std::string command = "COHORT_CODEC_PATH=" + std::string(value) + " " + self +
                                " --gtest_filter=CodecPaths.PathFromTheEnvironment > /dev/null";
    EXPECT_EQ(std::system(command.c_str()), 0) << command;
  }
}

std::vector<uint32_t> bitsOf(std::span<const float> values) {
  std::vector<uint32_t> bits;
  for (float v : values) bits.push_back(std::bit_cast<uint32_t>(v));
  return bits;
}

// Floats where a conversion can go wrong, each with both signs.
std::vector<float> adversarialFloats() {
  const std::vector<uint32_t> patterns = {
      0x00000000, 0x00000001, 0x007fffff, 0x00800000,  // zero, float subnormals
      0x33000000, 0x33000001, 0x337fffff, 0x33800000,  // 2^-25 (a tie to zero), around 2^-24
      0x387fc000, 0x387fe000, 0x387fffff, 0x38800000,  // the top of fp16's subnormals, 2^-14
      0x3f801000, 0x3f803000, 0x3f800fff, 0x3f801001,  // 1 + half an fp16 ulp: ties to even, near ties
      0x3f808000, 0x3f818000, 0x3f807fff, 0x3f808001,  // 1 + half a bf16 ulp: ties to even, near ties
      0x477fe000, 0x477fefff, 0x477ff000, 0x477ff001,  // 65504, 65519.99, 65520 (saturates), above
      0x47800000, 0x7f7f7fff, 0x7f7f8000, 0x7f7fffff,  // 65536, bf16's overflow boundary, FLT_MAX
      0x7f800000, 0x7f800001, 0x7f801000, 0x7fa00000,  // inf, signalling NaNs (payload low, high)
      0x7fc00000, 0x7fc00001, 0x7fffe000, 0x7fffffff,  // quiet NaNs
  };
  std::vector<float> out;
  for (uint32_t p : patterns) {
    out.push_back(std::bit_cast<float>(p));
    out.push_back(std::bit_cast<float>(p | 0x80000000u));
  }
  for (uint32_t k = 0; k <= 2048; k += 7) out.push_back((float(k) + 0.5f) * 0x1p-24f);  // subnormal ties
  return out;
}

// Adversarial values among random bit patterns and gaussian ones, shuffled.
std::vector<float> mixedFloats(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<float> v = adversarialFloats();
  const auto g = gaussian(n / 2, seed + 1, 1e-3f);
  v.insert(v.end(), g.begin(), g.end());
  while (v.size() < n) v.push_back(std::bit_cast<float>(uint32_t(rng())));
  std::shuffle(v.begin(), v.end(), rng);
  v.resize(n);
  return v;
}

TEST(CodecPaths, TheVectorConversionsRunOnThisMachine) {
  // Otherwise the comparisons below would compare the scalar code with itself.
  ASSERT_TRUE(vectorConversions()) << "this CPU lacks AVX2 or F16C: the vector conversions cannot be tested here";
}

TEST(CodecPaths, ConversionsAreBitIdentical) {
  const auto values = mixedFloats(20011, 21);
  // Every offset and a length that is not a multiple of 8: unaligned starts and scalar tails.
  for (size_t offset = 0; offset < 9; ++offset) {
    const std::span<const float> in(values.data() + offset, values.size() - 2 * offset);
    for (bool bf16 : {false, true}) {
      SCOPED_TRACE(bf16 ? "bf16" : "fp16");
      auto encode = [&] {
        std::vector<uint16_t> out(in.size());
        bf16 ? floatsToBf16(in, out) : floatsToHalf(in, out);
        return out;
      };
      const auto fast = onPath(CodecPath::Fast, encode);
      const auto reference = onPath(CodecPath::Reference, encode);
      for (size_t i = 0; i < in.size(); ++i) {
        ASSERT_EQ(fast[i], bf16 ? floatToBf16(in[i]) : floatToHalf(in[i]))
            << "offset " << offset << " input 0x" << std::hex << std::bit_cast<uint32_t>(in[i]);
      }
      ASSERT_EQ(fast, reference);
    }
  }
  // Every 16-bit pattern back to float, signalling NaNs included.
  std::vector<uint16_t> all(0x10000 + 5);
  for (size_t i = 0; i < all.size(); ++i) all[i] = uint16_t(i);
  for (bool bf16 : {false, true}) {
    auto decode = [&] {
      std::vector<float> out(all.size());
      bf16 ? bf16ToFloats(all, out) : halfToFloats(all, out);
      return bitsOf(out);
    };
    const auto fast = onPath(CodecPath::Fast, decode);
    ASSERT_EQ(fast, onPath(CodecPath::Reference, decode));
    for (size_t i = 0; i < all.size(); ++i) {
      ASSERT_EQ(fast[i], std::bit_cast<uint32_t>(bf16 ? bf16ToFloat(all[i]) : halfToFloat(all[i]))) << i;
    }
  }
}

// Encoders and decodeAdd of every codec give the same messages, residuals and sums on both paths,
// over several steps (so that residuals carry over) of adversarial and gaussian inputs.
TEST(CodecPaths, EncodersAndDecodersAreBitIdentical) {
  const char* codecs[] = {"none",           "fp16",          "bf16",    "topk:0.1",  "topk:0.001", "topk:1",
                          "threshold:0.5", "threshold:0.001", "onebit", "topk:0.3",   "threshold:0.01"};
  for (size_t n : {size_t(0), size_t(1), size_t(7), size_t(100), size_t(5003), size_t(70001)}) {
    for (const char* text : codecs) {
      SCOPED_TRACE(std::string(text) + " n=" + std::to_string(n));
      auto run = [&] {
        Encoder enc(CodecSpec::parse(text), n);
        std::vector<std::vector<uint8_t>> messages;
        std::vector<std::vector<uint32_t>> residuals, sums;
        for (int step = 0; step < 6; ++step) {
          // Steps 0 and 3 carry the adversarial values, the others gaussian ones of varied scale.
          const auto input = step % 3 == 0 ? mixedFloats(n, uint32_t(step)) : gaussian(n, 50 + step, step * 0.01f);
          messages.push_back(enc.encode(input));
          residuals.push_back(bitsOf(enc.residual()));
          std::vector<float> out = gaussian(n, 90 + step);
          decodeAdd(messages.back(), out, step % 2 ? 1.0f : -0.375f);
          sums.push_back(bitsOf(out));
        }
        return std::tuple(messages, residuals, sums);
      };
      const auto [fastMessages, fastResiduals, fastSums] = onPath(CodecPath::Fast, run);
      const auto [refMessages, refResiduals, refSums] = onPath(CodecPath::Reference, run);
      for (size_t step = 0; step < fastMessages.size(); ++step) {
        ASSERT_EQ(fastMessages[step], refMessages[step]) << "step " << step;
        ASSERT_EQ(fastResiduals[step], refResiduals[step]) << "step " << step;
        ASSERT_EQ(fastSums[step], refSums[step]) << "step " << step;
      }
    }
  }
}

// Runs f with the Fast path's tuning set to `tuning`, then puts back what was set.
template <typename F>
auto withTuning(FastPathTuning tuning, F&& f) {
  struct Restore {
    FastPathTuning before = fastPathTuning();
    ~Restore() { setFastPathTuning(before); }
  } restore;
  setFastPathTuning(tuning);
  return f();
}

// Inputs that stress topk's sampled threshold: heavy ties, mostly zeros, non-finite entries, a
// few huge entries in one stretch, and plain gaussians.
std::vector<float> topkInput(int shape, size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  auto v = gaussian(n, seed, 1e-3f);
  switch (shape) {
    case 0: break;
    case 1:  // five values only: long runs of ties at every rank
      for (auto& x : v) x = float(int(rng() % 5) - 2) * 0.25f;
      break;
    case 2:  // 99.5% zeros
      for (auto& x : v) x = rng() % 200 == 0 ? x : 0.0f;
      break;
    case 3:  // NaN and infinities among the values
      for (size_t i = 0; i < n; i += 97) v[i] = i % 3 == 0 ? NAN : i % 3 == 1 ? INFINITY : -INFINITY;
      break;
    case 4:  // the largest entries all in one stretch
      for (size_t i = n / 3; i < n / 3 + n / 50; ++i) v[i] *= 1000.0f;
      break;
  }
  return v;
}

// The sampled threshold only narrows the candidates: the same entries as the full selection, so
// exactly k of the finite ones (fewer only when fewer are nonzero), whatever the sample says.
TEST(CodecPaths, SampledTopKSendsWhatTheFullSelectionSends) {
  const std::vector<FastPathTuning> tunings = {
      {},                                               // the default
      {.topkSampleSigmas = -1e9},                       // the estimate far too high: always the rescan
      {.topkSampleSigmas = 30, .topkMinSampledLength = 0},  // sampled however short, far too low
  };
  for (size_t tuning = 0; tuning < tunings.size(); ++tuning) {
    for (int shape = 0; shape < 5; ++shape) {
      for (double ratio : {1e-6, 0.001, 0.01, 0.3, 1.0}) {
        for (size_t n : {size_t(33), size_t(40000)}) {
          SCOPED_TRACE("tuning " + std::to_string(tuning) + " shape " + std::to_string(shape) + " ratio " +
                       std::to_string(ratio) + " n " + std::to_string(n));
          const CodecSpec spec{.kind = CodecKind::TopK, .ratio = ratio};
          auto run = [&] {
            Encoder enc(spec, n);
            std::vector<std::vector<uint8_t>> messages;
            std::vector<size_t> sent;
            for (int step = 0; step < 3; ++step) {
              messages.push_back(enc.encode(topkInput(shape, n, uint32_t(7 * step + shape))));
              sent.push_back(enc.lastSent());
            }
            return std::pair(messages, sent);
          };
          const auto fast = withTuning(tunings[tuning], [&] { return onPath(CodecPath::Fast, run); });
          const auto reference = onPath(CodecPath::Reference, run);
          ASSERT_EQ(fast.first, reference.first);
          ASSERT_EQ(fast.second, reference.second);
          // The count on the first step, from the input alone.
          const auto input = topkInput(shape, n, uint32_t(shape));
          size_t finite = 0, nonzero = 0;
          for (float x : input) {
            finite += std::isfinite(x);
            nonzero += std::isfinite(x) && x != 0.0f;
          }
          const size_t k = size_t(std::ceil(ratio * double(finite)));
          EXPECT_EQ(fast.second[0], std::min(k, nonzero) + (n - finite));
        }
      }
    }
  }
}

// sent + residual == acc, bit for bit, on the sampled path too (buffers long enough to sample).
TEST(CodecPaths, SampledTopKKeepsTheResidualExact) {
  const size_t n = 60000;
  Encoder enc(CodecSpec::parse("topk:0.01"), n);
  std::vector<float> residual(n, 0.0f);
  for (int step = 0; step < 20; ++step) {
    const auto input = gaussian(n, 300 + step, step % 4 == 0 ? 1.0f : 1e-3f);
    const auto sent = decode(enc.encode(input), n);
    EXPECT_EQ(enc.lastSent(), n / 100);
    for (size_t i = 0; i < n; ++i) {
      const float acc = residual[i] + input[i];
      ASSERT_EQ(double(sent[i]) + double(enc.residual()[i]), double(acc)) << "step " << step << " entry " << i;
      ASSERT_TRUE(sent[i] == 0.0f || enc.residual()[i] == 0.0f);
      residual[i] = enc.residual()[i];
    }
  }
}

// onebit's scales are means of sums in double; the Fast path sums in eight lanes and keeps the
// result only when it provably rounds to the same float as the reference's sequential sum. Here
// the means sit exactly between two floats (a tie: the lanes cannot decide, so the reference sums
// run) or the sums lose low bits in different places.
TEST(CodecPaths, OneBitScalesMatchTheSequentialSums) {
  const float next = std::nextafter(1.0f, 2.0f);
  std::vector<std::vector<float>> inputs;
  inputs.push_back({});
  for (int i = 0; i < 64; ++i) inputs.back().push_back(i % 4 == 0 ? 1.0f : i % 4 == 1 ? next : i % 4 == 2 ? -1.0f : -next);
  inputs.push_back(std::vector<float>(1001, 1.0f));
  inputs.back()[0] = 1e16f;  // the sequential sum rounds every 1 that follows away, the lanes keep them
  inputs.back()[500] = -3e15f;
  inputs.push_back(gaussian(100003, 5, 1e-3f));
  for (size_t i = 0; i < inputs.back().size(); i += 3) inputs.back()[i] *= 1e6f;
  for (const auto& input : inputs) {
    auto run = [&] {
      Encoder enc(CodecSpec::parse("onebit"), input.size());
      auto message = enc.encode(input);
      return std::pair(message, bitsOf(enc.residual()));
    };
    EXPECT_EQ(onPath(CodecPath::Fast, run), onPath(CodecPath::Reference, run)) << input.size();
  }
}

// ---- malformed messages ------------------------------------------------------------------------

void expectMalformed(const std::vector<uint8_t>& message, size_t n, const std::string& words) {
  std::vector<float> out(n, 7.0f);
  try {
    decodeAdd(message, out);
    ADD_FAILURE() << "accepted; expected an error with '" << words << "'";
  } catch (const MalformedMessage& e) {
    EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what();
  }
  for (float v : out) ASSERT_EQ(v, 7.0f) << "a rejected message changed the buffer";
}

std::vector<uint8_t> header(CodecKind kind, uint64_t length, float param, uint32_t bodyBytes) {
  std::vector<uint8_t> m{'C', 'O', 'C', 'M', 1, uint8_t(kind), 0, 0};
  for (int i = 0; i < 8; ++i) m.push_back(uint8_t(length >> (8 * i)));
  uint32_t p = std::bit_cast<uint32_t>(param);
  for (int i = 0; i < 4; ++i) m.push_back(uint8_t(p >> (8 * i)));
  for (int i = 0; i < 4; ++i) m.push_back(uint8_t(bodyBytes >> (8 * i)));
  return m;
}

TEST(CodecDecode, RejectsBrokenHeaders) {
  Encoder enc(CodecSpec::parse("threshold:0.5"), 100);
  const auto good = enc.encode(gaussian(100, 3));
  auto m = good;
  m[0] = 'X';
  expectMalformed(m, 100, "magic");
  m = good;
  m[4] = 2;
  expectMalformed(m, 100, "version 2");
  m = good;
  m[5] = 9;
  expectMalformed(m, 100, "unknown codec 9");
  m = good;
  m[6] = 2;
  expectMalformed(m, 100, "form 2");
  m = good;
  m[7] = 1;
  expectMalformed(m, 100, "reserved");
  Encoder onebit(CodecSpec::parse("onebit"), 100);
  m = onebit.encode(gaussian(100, 3));
  m[6] = 1;  // the bitmap form is topk's and threshold's only
  expectMalformed(m, 100, "form 1 for codec 5");
  expectMalformed(good, 99, "holds 100 entries for a buffer of 99");
  expectMalformed(std::vector<uint8_t>(good.begin(), good.begin() + 10), 100, "truncated");
  expectMalformed({}, 100, "truncated");
  // An absurd length is refused before anything is allocated.
  expectMalformed(header(CodecKind::TopK, uint64_t(1) << 40, 0.5f, 10), 100, "beyond the limit");
  // A body size that the length cannot need is refused before decompressing.
  expectMalformed(header(CodecKind::Threshold, 100, 0.5f, 0xffffffffu), 100, "more than 100 entries can take");
  expectMalformed(header(CodecKind::Threshold, 100, -1.0f, 10), 100, "tau");
  expectMalformed(header(CodecKind::TopK, 100, 2.0f, 10), 100, "ratio");
  expectMalformed(header(CodecKind::OneBit, 100, 1.0f, 10), 100, "parameter");
}

TEST(CodecDecode, RejectsTruncatedOrPaddedMessagesOfEveryCodec) {
  const auto input = gaussian(100, 4);
  for (const char* text : kAll) {
    SCOPED_TRACE(text);
    Encoder enc(CodecSpec::parse(text), input.size());
    const auto good = enc.encode(input);
    for (size_t cut : {size_t(1), size_t(2), good.size() / 2, good.size() - kHeaderBytes}) {
      expectMalformed(std::vector<uint8_t>(good.begin(), good.end() - cut), 100, "");
    }
    auto longer = good;
    longer.push_back(0);
    expectMalformed(longer, 100, "");
  }
}

TEST(CodecDecode, RejectsBadZstdFrames) {
  const auto input = gaussian(100, 5);
  Encoder enc(CodecSpec::parse("topk:0.05"), input.size());
  auto m = enc.encode(input);
  ASSERT_EQ(m[6], 0) << "a sparse topk message is a zstd'd list";
  // Garbage in place of the frame, keeping the length.
  for (size_t i = kHeaderBytes; i < m.size(); ++i) m[i] = uint8_t(i * 37);
  expectMalformed(m, 100, "zstd");
  // A frame whose declared size disagrees with the header.
  m = enc.encode(input);
  m[20] ^= 1;
  expectMalformed(m, 100, "the header says");
  // A broken zstd frame header. (A flipped bit inside a literal float cannot be caught: frames
  // carry no checksum, TCP has one.)
  m = enc.encode(input);
  m[kHeaderBytes] ^= 0xff;
  expectMalformed(m, 100, "not a zstd frame");
  // A frame cut short inside, with the message length following the cut.
  m = enc.encode(input);
  m.resize(m.size() - 5);
  expectMalformed(m, 100, "zstd");
}

// A sparse message built by hand around `body`, so that each case breaks exactly one rule.
std::vector<uint8_t> sparseMessage(CodecKind kind, uint64_t length, float param, const std::vector<uint8_t>& body) {
  auto m = header(kind, length, param, uint32_t(body.size()));
  std::vector<uint8_t> frame(ZSTD_compressBound(body.size()));
  frame.resize(ZSTD_compress(frame.data(), frame.size(), body.data(), body.size(), 1));
  m.insert(m.end(), frame.begin(), frame.end());
  return m;
}
std::vector<uint8_t> list(uint32_t n, std::vector<uint8_t> varints, uint8_t isValue, uint8_t negative,
                          std::vector<float> values) {
  std::vector<uint8_t> b;
  for (int i = 0; i < 4; ++i) b.push_back(uint8_t(n >> (8 * i)));
  b.insert(b.end(), varints.begin(), varints.end());
  if (n > 0) {
    b.push_back(isValue);
    b.push_back(negative);
  }
  for (float v : values) {
    const uint32_t bits = std::bit_cast<uint32_t>(v);
    for (int i = 0; i < 4; ++i) b.push_back(uint8_t(bits >> (8 * i)));
  }
  return b;
}

TEST(CodecDecode, RejectsBadIndices) {
  const float tau = 0.5f;
  // A well-formed hand-made message first, so the cases below fail for their own reason.
  std::vector<float> out(10, 0.0f);
  decodeAdd(sparseMessage(CodecKind::Threshold, 10, tau, list(2, {3, 4}, 0b00, 0b10, {})), out);
  EXPECT_EQ(out[3], 0.5f);
  EXPECT_EQ(out[7], -0.5f);

  expectMalformed(sparseMessage(CodecKind::Threshold, 10, tau, list(2, {3, 7}, 0, 0, {})), 10, "out of range");
  expectMalformed(sparseMessage(CodecKind::Threshold, 10, tau, list(1, {10}, 0, 0, {})), 10, "out of range");
  expectMalformed(sparseMessage(CodecKind::Threshold, 10, tau, list(2, {3, 0}, 0, 0, {})), 10, "repeated");
  expectMalformed(sparseMessage(CodecKind::Threshold, 10, tau, list(11, {}, 0, 0, {})), 10, "11 entries");
  expectMalformed(sparseMessage(CodecKind::Threshold, 10, tau, list(2, {3}, 0, 0, {})), 10, "");
  expectMalformed(sparseMessage(CodecKind::Threshold, 10, tau, list(1, {0x80, 0x80, 0x80, 0x80, 0x7f}, 0, 0, {})), 10,
                  "varint");
  expectMalformed(sparseMessage(CodecKind::Threshold, 10, tau, list(1, {0x81, 0x00}, 0, 0, {})), 10, "overlong");
  // Missing float for a value entry; a value entry with a sign; bits past the end.
  expectMalformed(sparseMessage(CodecKind::Threshold, 10, tau, list(1, {2}, 1, 0, {})), 10, "truncated");
  expectMalformed(sparseMessage(CodecKind::Threshold, 10, tau, list(1, {2}, 1, 1, {1.0f})), 10, "sign bit");
  expectMalformed(sparseMessage(CodecKind::Threshold, 10, tau, list(1, {2}, 0b10, 0, {})), 10, "past its end");
  expectMalformed(sparseMessage(CodecKind::Threshold, 10, tau, list(1, {2}, 0, 0, {1.0f})), 10, "trailing");
  // topk carries values only.
  expectMalformed(sparseMessage(CodecKind::TopK, 10, 0.5f, list(1, {2}, 0, 0, {})), 10, "sign entry");
  // onebit: scales, signs, escapes.
  std::vector<uint8_t> onebit{0, 0, 0x80, 0x3f, 0, 0, 0x80, 0x3f, 0xff, 0x03};  // 1.0, 1.0, 10 bits
  auto withList = [&](std::vector<uint8_t> head, std::vector<uint8_t> tail) {
    head.insert(head.end(), tail.begin(), tail.end());
    return head;
  };
  out.assign(10, 0.0f);
  decodeAdd(sparseMessage(CodecKind::OneBit, 10, 0.0f, withList(onebit, list(0, {}, 0, 0, {}))), out);
  EXPECT_EQ(out, std::vector<float>(10, -1.0f));
  expectMalformed(sparseMessage(CodecKind::OneBit, 10, 0.0f, withList(onebit, list(1, {2}, 1, 0, {5.0f}))), 10,
                  "escaped entry has its sign bit set");
  auto padded = onebit;
  padded[9] = 0x07;
  expectMalformed(sparseMessage(CodecKind::OneBit, 10, 0.0f, withList(padded, list(0, {}, 0, 0, {}))), 10,
                  "past its end");
  auto negScale = onebit;
  negScale[3] = 0xbf;
  expectMalformed(sparseMessage(CodecKind::OneBit, 10, 0.0f, withList(negScale, list(0, {}, 0, 0, {}))), 10,
                  "scales");
}

// The bitmap form of topk's and threshold's lists (header byte 6 = 1), by hand: u32 n, u32 v,
// the sent bitmap, the value entries' u32 ordinals when 0 < v < n, the sign bitmap, the floats.
std::vector<uint8_t> bitmapMessage(CodecKind kind, uint64_t length, float param, const std::vector<uint8_t>& body) {
  auto m = header(kind, length, param, uint32_t(body.size()));
  m[6] = 1;
  m.insert(m.end(), body.begin(), body.end());
  return m;
}
std::vector<uint8_t> bitmapBody(uint32_t n, uint32_t v, std::vector<uint8_t> bitmaps, std::vector<float> values = {}) {
  std::vector<uint8_t> b;
  for (int i = 0; i < 4; ++i) b.push_back(uint8_t(n >> (8 * i)));
  for (int i = 0; i < 4; ++i) b.push_back(uint8_t(v >> (8 * i)));
  b.insert(b.end(), bitmaps.begin(), bitmaps.end());
  for (float x : values) {
    const uint32_t bits = std::bit_cast<uint32_t>(x);
    for (int i = 0; i < 4; ++i) b.push_back(uint8_t(bits >> (8 * i)));
  }
  return b;
}

TEST(Codec, DenseListsTakeTheBitmapForm) {
  const size_t n = 100003;  // not a multiple of 8 or 64: the tails
  const auto input = gaussian(n, 11, 1.0f);
  struct Case {
    const char* codec;
    uint8_t form;
  };
  // |x| >= 0.5 for 62 % of N(0, 1), >= 2.5 for 1.2 %; topk:0.6 and topk:0.01 likewise.
  for (const auto& [text, form] : {Case{"threshold:0.5", 1}, Case{"threshold:2.5", 0}, Case{"topk:0.6", 1},
                                   Case{"topk:0.01", 0}}) {
    SCOPED_TRACE(text);
    Encoder enc(CodecSpec::parse(text), n);
    std::vector<float> residual(n, 0.0f);
    // Three steps: the residual carries over; the split stays exact in whichever form is sent.
    for (uint32_t step = 0; step < 3; ++step) {
      const auto in = step == 0 ? input : gaussian(n, 20 + step, 1.0f);
      const auto message = enc.encode(in);
      if (step == 0) {
        EXPECT_EQ(message[6], form);
        if (form == 1) {
          // Raw: the header, two counts, the sent bitmap, the sign bits (threshold) or the floats.
          const size_t sent = enc.lastSent();
          const size_t expected = enc.spec().kind == CodecKind::Threshold ? (sent + 7) / 8 : 4 * sent;
          EXPECT_EQ(message.size(), kHeaderBytes + 8 + (n + 7) / 8 + expected);
        }
      }
      const auto out = decode(message, n);
      for (size_t i = 0; i < n; ++i) {
        const float acc = residual[i] + in[i];
        ASSERT_EQ(double(out[i]) + double(enc.residual()[i]), double(acc)) << "step " << step << " entry " << i;
        residual[i] = enc.residual()[i];
      }
    }
  }
}

// Value entries inside a bitmap-form message: entries beyond 2^16 tau and non-finite ones, among
// sign entries, decode to what the list form would give and keep the exact split.
TEST(Codec, TheBitmapFormCarriesValueEntries) {
  const size_t n = 1000;
  auto input = gaussian(n, 12, 1.0f);
  input[5] = 1e6f;
  input[77] = -3e5f;
  input[500] = NAN;
  input[999] = INFINITY;
  for (CodecPath path : {CodecPath::Fast, CodecPath::Reference}) {
    const auto [message, residual] = onPath(path, [&] {
      Encoder enc(CodecSpec::parse("threshold:0.5"), n);
      auto m = enc.encode(input);
      return std::pair(m, std::vector<float>(enc.residual().begin(), enc.residual().end()));
    });
    ASSERT_EQ(message[6], 1);
    const auto out = decode(message, n);
    for (size_t i = 0; i < n; ++i) {
      if (!std::isfinite(input[i])) {
        EXPECT_TRUE(sameBits(out[i], input[i])) << i;
        EXPECT_EQ(residual[i], 0.0f);
        continue;
      }
      ASSERT_EQ(double(out[i]) + double(residual[i]), double(input[i])) << i;
    }
    EXPECT_NEAR(out[5], 0.5f, 0.25f);  // about tau, from a value entry
    EXPECT_NEAR(out[77], -0.5f, 0.25f);
  }
}

TEST(CodecDecode, RejectsMalformedBitmapForms) {
  const float tau = 0.5f;
  const auto th = CodecKind::Threshold;
  // 10 entries: 3 and 7 sent, 7 negative. Well-formed first, so that the cases fail for their own reason.
  std::vector<float> out(10, 0.0f);
  decodeAdd(bitmapMessage(th, 10, tau, bitmapBody(2, 0, {0x88, 0x00, 0b10})), out);
  EXPECT_EQ(out, (std::vector<float>{0, 0, 0, 0.5f, 0, 0, 0, -0.5f, 0, 0}));
  // With a value entry (7, 2.5) between two sign entries.
  out.assign(10, 0.0f);
  decodeAdd(bitmapMessage(th, 10, tau, bitmapBody(3, 1, {0x88, 0x02, 1, 0, 0, 0, 0b10}, {2.5f})), out);
  EXPECT_EQ(out, (std::vector<float>{0, 0, 0, 0.5f, 0, 0, 0, 2.5f, 0, -0.5f}));

  expectMalformed(bitmapMessage(th, 10, tau, bitmapBody(3, 0, {0x88, 0x00, 0b10})), 10, "2 bits set, the count says 3");
  expectMalformed(bitmapMessage(th, 10, tau, bitmapBody(11, 0, {0x88, 0x00, 0b10})), 10, "11 entries");
  expectMalformed(bitmapMessage(th, 10, tau, bitmapBody(2, 3, {0x88, 0x00, 0b10})), 10, "3 value entries of 2");
  expectMalformed(bitmapMessage(th, 10, tau, bitmapBody(2, 0, {0x88, 0x04, 0b10})), 10, "the sent bitmap has bits set past");
  expectMalformed(bitmapMessage(th, 10, tau, bitmapBody(2, 0, {0x88, 0x00, 0b110})), 10, "the sign bitmap has bits set past");
  expectMalformed(bitmapMessage(th, 10, tau, bitmapBody(3, 1, {0x88, 0x02, 3, 0, 0, 0, 0b1}, {2.5f})), 10,
                  "ordinal 3 of 3 entries");
  expectMalformed(bitmapMessage(th, 10, tau, bitmapBody(3, 2, {0x88, 0x02, 1, 0, 0, 0, 1, 0, 0, 0, 0b1}, {2.5f, 1.0f})),
                  10, "not increasing");
  expectMalformed(bitmapMessage(th, 10, tau, bitmapBody(3, 1, {0x88, 0x02, 1, 0, 0, 0, 0b10})), 10, "truncated");
  expectMalformed(bitmapMessage(th, 10, tau, bitmapBody(2, 0, {0x88, 0x00, 0b10, 0})), 10, "trailing");
  expectMalformed(bitmapMessage(th, 10, tau, bitmapBody(2, 0, {0x88, 0x00})), 10, "truncated");
  // topk carries value entries only.
  expectMalformed(bitmapMessage(CodecKind::TopK, 10, 0.5f, bitmapBody(2, 1, {0x88, 0x00, 0b01, 0}, {1.0f})), 10,
                  "sign entry");
  out.assign(10, 0.0f);
  decodeAdd(bitmapMessage(CodecKind::TopK, 10, 0.5f, bitmapBody(2, 2, {0x88, 0x00}, {1.0f, -2.0f})), out);
  EXPECT_EQ(out, (std::vector<float>{0, 0, 0, 1.0f, 0, 0, 0, -2.0f, 0, 0}));
  // The header's body size is the body's: no zstd frame to hide a difference.
  auto m = bitmapMessage(th, 10, tau, bitmapBody(2, 0, {0x88, 0x00, 0b10}));
  m[20] += 1;
  expectMalformed(m, 10, "bitmap-form body of 11 bytes (header: 12)");
  // More than any bitmap form of 10 entries can take, refused from the header.
  expectMalformed(bitmapMessage(th, 10, tau, std::vector<uint8_t>(100, 0)), 10, "more than 10 entries can take");
}

TEST(Codec, CompressesSparseUpdates) {
  // 1% of a million entries: index deltas and signs, well under 2 bytes an entry after zstd.
  const size_t n = 1000000;
  auto input = gaussian(n, 9, 0.01f);
  Encoder enc(CodecSpec::parse("threshold:0.0258"), n);
  const auto m = enc.encode(input);
  EXPECT_GT(enc.lastSent(), n / 200);
  EXPECT_LT(enc.lastSent(), n / 50);
  EXPECT_LT(double(m.size()) / double(enc.lastSent()), 2.0);
  Encoder topk(CodecSpec::parse("topk:0.01"), n);
  const auto mt = topk.encode(input);
  EXPECT_EQ(topk.lastSent(), n / 100);
  EXPECT_LT(double(mt.size()) / double(topk.lastSent()), 6.0);
  Encoder onebit(CodecSpec::parse("onebit"), n);
  EXPECT_LT(onebit.encode(input).size(), n / 8 + 200);
}

}  // namespace
