// topk's, threshold's and onebit's device pass (schemes/device_select.h), run on CPU tensors,
// against the CPU encoder: the same messages byte for byte and the same residuals bit for bit,
// round after round (tests/gpu_codec_test.cpp runs it on a GPU inside CompressedSum).
#include "schemes/device_select.h"
#include "compress/codec.h"
#include "schemes/compressed.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

namespace cohort::device_select_test {
namespace {

// Normal values with what the passes treat specially planted: ties of magnitude at several
// levels (ties in index order decide topk), zeros and -0, NaN and infinities, values from 2^16 tau
// to beyond 2^24 tau (threshold's value entries), and values exactly at +-tau.
torch::Tensor plantedInput(int64_t n, int round, float tau) {
  torch::manual_seed(uint64_t(11 + round));
  torch::Tensor x = torch::randn({n}) * 0.02;
  float* p = x.data_ptr<float>();
  for (int64_t i = 0; i < n; i += 97) p[i] = (i % 2 ? -1.0f : 1.0f) * 0.03125f;  // a tie of many
  for (int64_t i = 13; i < n; i += 101) p[i] = 0.0f;
  for (int64_t i = 29; i < n; i += 211) p[i] = -0.0f;
  for (int64_t i = 7; i < n; i += 503) p[i] = (i % 3 ? 1.0f : -1.0f) * tau;
  if (n > 4000) {
    p[100 + round] = std::numeric_limits<float>::quiet_NaN();
    p[200] = round == 1 ? -std::numeric_limits<float>::infinity() : 0.5f;
    p[300] = tau * 70000.0f;       // beyond 2^16 tau: a value entry keeping a rounded residual
    p[301] = -tau * 3.0e7f;        // beyond 2^24 tau: sent whole
    p[302] = std::ldexp(tau, 16);  // exactly 2^16 tau
  }
  return x;
}

std::string firstBitDifference(const torch::Tensor& a, std::span<const float> b) {
  const float* p = a.data_ptr<float>();
  for (size_t i = 0; i < b.size(); ++i) {
    if (std::memcmp(p + i, b.data() + i, 4) != 0) {
      return "entry " + std::to_string(i) + ": " + std::to_string(p[i]) + " against " + std::to_string(b[i]);
    }
  }
  return "";
}

class DeviceSelectCase : public ::testing::TestWithParam<std::string> {};

TEST_P(DeviceSelectCase, WritesTheCpuEncodersMessagesAndResiduals) {
  const auto spec = compress::CodecSpec::parse(GetParam());
  const float tau = spec.kind == compress::CodecKind::Threshold ? spec.tau : 0.01f;
  for (int64_t n : {int64_t(1), int64_t(300), int64_t(50021)}) {
    compress::Encoder cpu(spec, size_t(n));
    compress::Encoder host(spec, size_t(n));
    DeviceSelect device(spec, n, c10::Device(c10::kCPU));
    std::vector<uint8_t> expected, got;
    for (int round = 0; round < 4; ++round) {
      const torch::Tensor input = plantedInput(n, round, tau);
      cpu.encode({input.data_ptr<float>(), size_t(n)}, expected);
      device.encode(input, host, got);
      const std::string where = spec.text() + ", " + std::to_string(n) + " floats, round " + std::to_string(round);
      EXPECT_EQ(host.lastSent(), cpu.lastSent()) << where;
      EXPECT_TRUE(got == expected) << where << ": messages of " << got.size() << " and " << expected.size() << " bytes";
      EXPECT_EQ(firstBitDifference(device.residual(), cpu.residual()), "") << where << ": residual";
      const torch::Tensor again = plantedInput(n, round, tau);
      EXPECT_EQ(firstBitDifference(input, {again.data_ptr<float>(), size_t(n)}), "") << where << ": input written";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(SparseCodecs, DeviceSelectCase,
                         ::testing::Values("topk:0.01", "topk:0.3", "topk:1", "threshold:0.01", "threshold:0.5",
                                           "onebit"),
                         [](const auto& info) {
                           std::string name = info.param;
                           for (char& c : name) {
                             if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
                           }
                           return name;
                         });

TEST(DeviceSelect, RefusesTheCodecsWithoutASelection) {
  for (const char* codec : {"none", "fp16", "bf16"}) {
    EXPECT_THROW(DeviceSelect(compress::CodecSpec::parse(codec), 10, c10::Device(c10::kCPU)), InvalidArgument) << codec;
  }
  compress::Encoder onebit(compress::CodecSpec::parse("onebit"), 4);
  std::vector<uint8_t> message;
  const std::vector<int64_t> indices{1};
  const std::vector<float> values{1.0f};
  EXPECT_THROW(onebit.encodeSelected(indices, values, message), InvalidArgument);
  compress::Encoder topk(compress::CodecSpec::parse("topk:0.5"), 4);
  const std::vector<int64_t> backwards{2, 1};
  const std::vector<float> two{1.0f, 2.0f};
  EXPECT_THROW(topk.encodeSelected(backwards, two, message), InvalidArgument);
  const std::vector<int64_t> outside{4};
  EXPECT_THROW(topk.encodeSelected(outside, values, message), InvalidArgument);
  // onebit's parts: for onebit alone, a bitmap of bitmapBytes(length) bytes, escapes in order.
  const std::vector<uint8_t> oneByte{0};
  const std::vector<int64_t> none;
  const std::vector<float> noValues;
  EXPECT_THROW(topk.encodeOneBit({}, oneByte, none, noValues, message), InvalidArgument);
  EXPECT_NO_THROW(onebit.encodeOneBit({}, oneByte, none, noValues, message));
  EXPECT_THROW(onebit.encodeOneBit({}, std::vector<uint8_t>{0, 0}, none, noValues, message), InvalidArgument);
  EXPECT_THROW(onebit.encodeOneBit({}, oneByte, backwards, two, message), InvalidArgument);
  EXPECT_THROW(onebit.encodeOneBit({}, oneByte, outside, values, message), InvalidArgument);
  DeviceSelect onebitPass(compress::CodecSpec::parse("onebit"), 4, c10::Device(c10::kCPU));
  EXPECT_THROW(onebitPass.select(torch::zeros({4})), InvalidArgument) << "onebit selects nothing";
}

// onebit's means from sums made in another order: decided unless the mean lies so near a rounding
// boundary that the order of summing could move it across; then the CPU's order decides, which
// the pass does over acc (here: two positive entries whose mean is the midpoint of 1 and the next
// float, rounded to even).
TEST(DeviceSelect, OneBitsMeansUndecidedBySumsComeFromTheCpusOrder) {
  const float next = std::nextafter(1.0f, 2.0f);
  const double midpoint = (1.0 + double(next)) / 2;
  EXPECT_FALSE(compress::oneBitScalesFromSums(2 * midpoint, 2, 0.0, 0).has_value());
  const auto decided = compress::oneBitScalesFromSums(3.0, 3, 1.5, 3);
  ASSERT_TRUE(decided.has_value());
  EXPECT_EQ(decided->positive, 1.0f);
  EXPECT_EQ(decided->negative, 0.5f);
  const torch::Tensor input = torch::tensor({1.0f, next, -0.5f, -0.25f, -1.0f});
  const auto spec = compress::CodecSpec::parse("onebit");
  compress::Encoder cpu(spec, 5), host(spec, 5);
  DeviceSelect device(spec, 5, c10::Device(c10::kCPU));
  std::vector<uint8_t> expected, got;
  cpu.encode({input.data_ptr<float>(), 5}, expected);
  device.encode(input, host, got);
  EXPECT_TRUE(got == expected);
  EXPECT_EQ(firstBitDifference(device.residual(), cpu.residual()), "");
}

// onebit's magnitudes are summed kSumChunk entries at a time: a bucket of more than two chunks
// (the last one short) still gives the CPU's message and residual. In round 0 the sums decide the
// means (exact sums of 0.5, -0.25 and -3, the last chunk's -3s moving the negative mean), so the
// chunks' sums make the message; round 1's planted input may leave them to the CPU's order.
TEST(DeviceSelect, OneBitsSumsOverSeveralChunksGiveTheCpusMessage) {
  const int64_t n = 2 * DeviceSelect::kSumChunk + 5;
  const auto spec = compress::CodecSpec::parse("onebit");
  compress::Encoder cpu(spec, size_t(n)), host(spec, size_t(n));
  DeviceSelect device(spec, n, c10::Device(c10::kCPU));
  std::vector<uint8_t> expected, got;
  for (int round = 0; round < 2; ++round) {
    torch::Tensor input = plantedInput(n, round, 0.01f);
    if (round == 0) {
      input = torch::where(torch::arange(n).remainder(3).eq(0), -0.25f, 0.5f).to(torch::kFloat32);
      input.narrow(0, n - 5, 5).fill_(-3.0f);
    }
    cpu.encode({input.data_ptr<float>(), size_t(n)}, expected);
    device.encode(input, host, got);
    EXPECT_TRUE(got == expected) << "round " << round;
    EXPECT_EQ(firstBitDifference(device.residual(), cpu.residual()), "") << "round " << round;
  }
}

// COHORT_SPARSE_SELECT chooses where DataParallel's topk, threshold and onebit passes run on a GPU.
TEST(DeviceSelect, TheEnvironmentChoosesHostOrDevice) {
  const char* before = std::getenv("COHORT_SPARSE_SELECT");
  const std::string saved = before != nullptr ? before : "";
  ::unsetenv("COHORT_SPARSE_SELECT");
  EXPECT_EQ(selectOnFromEnvironment(), SelectOn::Host);
  ::setenv("COHORT_SPARSE_SELECT", "device", 1);
  EXPECT_EQ(selectOnFromEnvironment(), SelectOn::Device);
  ::setenv("COHORT_SPARSE_SELECT", "gpu", 1);
  try {
    selectOnFromEnvironment();
    ADD_FAILURE() << "COHORT_SPARSE_SELECT=gpu was taken";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("expected host"), std::string::npos) << e.what();
  }
  if (before != nullptr) {
    ::setenv("COHORT_SPARSE_SELECT", saved.c_str(), 1);
  } else {
    ::unsetenv("COHORT_SPARSE_SELECT");
  }
}

}  // namespace
}  // namespace cohort::device_select_test
