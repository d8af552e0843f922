// CompressedSum's 16-bit ring (fp16, bf16 summed in float32, the wire in 16 bits) against the
// path it replaced (c10d Gloo's allreduce of at::kHalf; bf16 allgathered and summed in float32),
// and its sparse exchanges, on ranks as threads over 127.0.0.1.
#include <cohort/communicator.h>

#include "compress/codec.h"
#include "schemes/compressed.h"

#include <torch/torch.h>

#include "rank_threads.h"

#include <cmath>

namespace cohort::compressed_sum_test {
namespace {

using test::onRanks;

std::span<float> floats(torch::Tensor& t) { return {t.data_ptr<float>(), size_t(t.numel())}; }
std::span<uint16_t> bits16(torch::Tensor& t) { return {reinterpret_cast<uint16_t*>(t.data_ptr()), size_t(t.numel())}; }

// Per rank, per buffer: normal values (made before the rank threads: torch's generator is one
// per process).
std::vector<std::vector<torch::Tensor>> makeInputs(int world, const std::vector<int64_t>& lengths, double sigma) {
  torch::manual_seed(3);
  std::vector<std::vector<torch::Tensor>> inputs(static_cast<size_t>(world));
  for (auto& rank : inputs) {
    for (int64_t n : lengths) rank.push_back(torch::randn({n}) * sigma);
  }
  return inputs;
}

// The path before the ring, on the same inputs: fp16 rounded, summed by Gloo in 16 bits, converted
// back; bf16 rounded, allgathered and summed in float32 in rank order.
torch::Tensor oldPath(Communicator& comm, const compress::CodecSpec& spec, torch::Tensor input) {
  auto wire = torch::empty({input.numel()}, torch::kHalf);
  auto out = torch::zeros_like(input);
  if (spec.kind == compress::CodecKind::Fp16) {
    compress::floatsToHalf(floats(input), bits16(wire));
    comm.allreduce(wire);
    compress::halfToFloats(bits16(wire), floats(out));
    return out;
  }
  compress::floatsToBf16(floats(input), bits16(wire));
  for (auto& t : comm.allgather(wire)) {
    auto part = torch::empty_like(input);
    compress::bf16ToFloats(bits16(t), floats(part));
    out += part;
  }
  return out;
}

struct RingCase {
  std::string codec;
  int world;
};

class SixteenBitRing : public ::testing::TestWithParam<RingCase> {};

// Lengths that leave chunks of unequal size and, with 3 ranks and 2 entries, an empty one; the
// longest sends each chunk as several segments (3 with 2 ranks, 2 with 3: chunks of 600 and 400 KB).
TEST_P(SixteenBitRing, EqualsThePathItReplacedWithinRoundingAndEveryRankGetsTheSameBits) {
  const auto [codec, world] = GetParam();
  const auto spec = compress::CodecSpec::parse(codec);
  const std::vector<int64_t> lengths = {1, 2, 7, 1000, 40001, 600001};
  const auto inputs = makeInputs(world, lengths, 1.0);
  std::vector<std::vector<torch::Tensor>> sums(static_cast<size_t>(world)), olds(static_cast<size_t>(world));
  onRanks(world, [&](std::shared_ptr<Communicator> comm) {
    const size_t r = size_t(comm->rank());
    CompressedSum sum(comm, spec, lengths);
    std::vector<torch::Tensor> flats;
    for (auto& in : inputs[r]) flats.push_back(in.clone());
    for (size_t b = 0; b < flats.size(); ++b) sum.start(b, flats[b]);  // all under way at once
    for (size_t b = 0; b < flats.size(); ++b) sum.finish(b, flats[b]);
    sums[r] = flats;
    for (auto& in : inputs[r]) olds[r].push_back(oldPath(*comm, spec, in.clone()));
    // 2 bytes an entry, every chunk but one in each phase. Sent: in the reduce-scatter all but
    // the chunk this rank ends up owning (rank + 1), in the allgather all but rank + 2's.
    // Received: all but its own chunk, then all but the one it owns.
    int64_t sent = 0, received = 0;
    for (int64_t n : lengths) {
      auto length = [&](int c) { return n * ((c % world) + 1) / world - n * (c % world) / world; };
      if (world == 1) continue;
      sent += 2 * (2 * n - length(int(r) + 1) - length(int(r) + 2));
      received += 2 * (2 * n - length(int(r)) - length(int(r) + 1));
    }
    EXPECT_EQ(sum.bytesSent(), sent);
    EXPECT_EQ(sum.bytesReceived(), received);
    const CompressedSum::Phases phases = sum.phases();
    EXPECT_GT(phases.encodeSeconds + phases.decodeSeconds, 0.0);
  });
  // The 16-bit codec's relative precision (fp16: 11 bits, bf16: 8), a rounding per hop plus the
  // inputs' rounding and the final one.
  const double ulp = spec.kind == compress::CodecKind::Fp16 ? std::ldexp(1.0, -10) : std::ldexp(1.0, -7);
  for (size_t b = 0; b < lengths.size(); ++b) {
    torch::Tensor exact = torch::zeros({lengths[b]}, torch::kFloat64);
    for (int r = 0; r < world; ++r) exact += inputs[size_t(r)][b].to(torch::kFloat64);
    double magnitude = 0;
    for (int r = 0; r < world; ++r) magnitude = std::max(magnitude, inputs[size_t(r)][b].abs().max().item<double>());
    const double tolerance = (world + 1) * ulp * magnitude * world;
    for (int r = 0; r < world; ++r) {
      EXPECT_TRUE(torch::equal(sums[size_t(r)][b], sums[0][b])) << "buffer " << b << ": rank " << r << " differs";
      const double fromExact = (sums[size_t(r)][b].to(torch::kFloat64) - exact).abs().max().item<double>();
      const double fromOld = (sums[size_t(r)][b] - olds[size_t(r)][b]).abs().max().item<double>();
      EXPECT_LE(fromExact, tolerance) << "buffer " << b;
      EXPECT_LE(fromOld, 2 * tolerance) << "buffer " << b;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(CodecsAndWorlds, SixteenBitRing,
                         ::testing::Values(RingCase{"fp16", 1}, RingCase{"fp16", 2}, RingCase{"fp16", 3},
                                           RingCase{"bf16", 2}, RingCase{"bf16", 3}),
                         [](const auto& info) { return info.param.codec + "_world" + std::to_string(info.param.world); });

// With 2 ranks the ring adds once and rounds once, as Gloo's 16-bit sum does; the only difference
// is that this rank's own values enter in float32 instead of rounded first. On inputs that are
// already binary16 values the two paths agree bit for bit.
TEST(SixteenBitRing, TwoRanksOnBinary16InputsEqualGloosHalfSumExactly) {
  const std::vector<int64_t> lengths = {4097};
  auto inputs = makeInputs(2, lengths, 1.0);
  for (auto& rank : inputs) rank[0] = rank[0].to(torch::kHalf).to(torch::kFloat32);
  std::vector<torch::Tensor> sums(2), olds(2);
  onRanks(2, [&](std::shared_ptr<Communicator> comm) {
    const size_t r = size_t(comm->rank());
    const auto spec = compress::CodecSpec::parse("fp16");
    CompressedSum sum(comm, spec, lengths);
    auto flat = inputs[r][0].clone();
    sum.start(0, flat);
    sum.finish(0, flat);
    sums[r] = flat;
    olds[r] = oldPath(*comm, spec, inputs[r][0].clone());
  });
  EXPECT_TRUE(torch::equal(sums[0], olds[0]));
  EXPECT_TRUE(torch::equal(sums[1], olds[1]));
}

// The sparse codecs on the communication thread: the same sum as decoding every rank's message
// in rank order by hand, on every rank, and the residual carried to the next start.
TEST(CompressedSum, SparseExchangeEqualsDecodingEveryMessageInRankOrder) {
  const std::vector<int64_t> lengths = {5000, 300};
  const auto inputs = makeInputs(2, lengths, 1e-2);
  for (const std::string codec : {"threshold:0.01", "topk:0.1", "onebit"}) {
    const auto spec = compress::CodecSpec::parse(codec);
    // The expected sums, from encoders of the test's own (two rounds: the second sees residuals).
    std::vector<torch::Tensor> expected;  // per buffer
    {
      std::vector<std::vector<compress::Encoder>> encoders(2);
      for (auto& e : encoders) {
        for (int64_t n : lengths) e.emplace_back(spec, size_t(n));
      }
      for (int round = 0; round < 2; ++round) {
        for (size_t b = 0; b < lengths.size(); ++b) {
          torch::Tensor total = torch::zeros({lengths[b]});
          for (size_t r = 0; r < 2; ++r) {
            auto in = inputs[r][b].clone();
            compress::decodeAdd(encoders[r][b].encode(floats(in)), floats(total));
          }
          if (round == 1) expected.push_back(total);
        }
      }
    }
    std::vector<std::vector<torch::Tensor>> got(2);
    onRanks(2, [&](std::shared_ptr<Communicator> comm) {
      const size_t r = size_t(comm->rank());
      CompressedSum sum(comm, spec, lengths);
      for (int round = 0; round < 2; ++round) {
        std::vector<torch::Tensor> flats;
        for (auto& in : inputs[r]) flats.push_back(in.clone());
        for (size_t b = 0; b < flats.size(); ++b) sum.start(b, flats[b]);
        for (size_t b = 0; b < flats.size(); ++b) sum.finish(b, flats[b]);
        if (round == 1) got[r] = flats;
      }
    });
    for (size_t r = 0; r < 2; ++r) {
      for (size_t b = 0; b < lengths.size(); ++b) {
        EXPECT_TRUE(torch::equal(got[r][b], expected[b])) << codec << " buffer " << b << " rank " << r;
      }
    }
  }
}

// A peer that never takes part: finish() ends with the communicator's error, naming the timeout,
// instead of waiting for ever; the handle can then be destroyed.
TEST(CompressedSum, APeerThatNeverAnswersEndsInAnError) {
  onRanks(
      2,
      [&](std::shared_ptr<Communicator> comm) {
        if (comm->rank() == 1) return;  // never starts its buffer
        CompressedSum sum(comm, compress::CodecSpec::parse("fp16"), {64});
        auto flat = torch::ones({64});
        sum.start(0, flat);
        try {
          sum.finish(0, flat);
          ADD_FAILURE() << "finish() returned without the peer";
        } catch (const CommError& e) {
          EXPECT_NE(std::string(e.what()).find("rank"), std::string::npos) << e.what();
        }
      },
      std::chrono::seconds(3));
}

}  // namespace
}  // namespace cohort::compressed_sum_test
