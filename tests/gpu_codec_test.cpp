// Every codec on a CUDA model (ctest label gpu; run by scripts/gpu-check.sh, never by CI). Without
// a GPU every test here fails at once, naming what is missing.
//
// Two depths: CompressedSum itself, 2 ranks as threads sharing cuda:0, against the same sums on the
// CPU bit for bit (what the device path must keep exactly); and `cohort train --strategy allreduce
// --codec X`, 2 processes sharing cuda:0, against the same run on the CPU within a tolerance (the
// GPU's float arithmetic rounds differently, and the codecs act on those roundings).
#include <cohort/communicator.h>
#include <cohort/device.h>
#include <cohort/error.h>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cctype>
#include <cmath>
#include <sstream>
#include <string>
#include <vector>

#include "compress/codec.h"
#include "model_util.h"
#include "rank_threads.h"
#include "schemes/compressed.h"
#include "gpu_util.h"
#include "test_util.h"

namespace cohort::gpu_codec_test {
namespace {

const c10::Device kCuda(c10::kCUDA, 0);

// "" when a and b (on any devices) are equal bit for bit; otherwise how they differ: how many
// elements, the first one and the largest difference.
std::string bitDifference(const torch::Tensor& a, const torch::Tensor& b) {
  const torch::Tensor x = a.cpu(), y = b.cpu();
  std::ostringstream out;
  if (x.sizes() != y.sizes() || x.scalar_type() != y.scalar_type()) {
    out << "shapes " << x.sizes() << " " << x.scalar_type() << " and " << y.sizes() << " " << y.scalar_type();
    return out.str();
  }
  const torch::Tensor differ = x.view(torch::kInt32).ne(y.view(torch::kInt32));
  const int64_t count = differ.sum().item<int64_t>();
  if (count == 0) return "";
  const int64_t first = differ.nonzero()[0][0].item<int64_t>();
  out << count << " of " << x.numel() << " elements differ; the first at " << first << ": "
      << x[first].item<float>() << " against " << y[first].item<float>() << "; the largest difference "
      << (x - y).abs().max().item<float>();
  return out.str();
}

// Queues about a millisecond of work on the current stream of cuda:0: a copy queued after it still
// waits when the code under test looks at the buffer, so that a missing stream dependency shows.
void keepTheStreamBusy() {
  const torch::Tensor a = torch::randn({2048, 2048}, torch::TensorOptions().device(kCuda));
  torch::mm(torch::mm(a, a), a);
}

// Rounds of buffers of this length, different each round, on every rank: normal values of
// standard deviation 1e-3 (gradients' scale), and some entries far larger (topk's and threshold's
// picks).
std::vector<torch::Tensor> makeRounds(int rank, int rounds, int64_t length) {
  auto gen = at::detail::createCPUGenerator(uint64_t(1000 + 17 * rank + length));
  std::vector<torch::Tensor> out;
  for (int i = 0; i < rounds; ++i) {
    torch::Tensor t = torch::randn({length}, gen) * 1e-3;
    t.index_put_({torch::randint(length, {length / 50 + 1}, gen)}, torch::randn({length / 50 + 1}, gen) * 0.05);
    out.push_back(t);
  }
  return out;
}

struct SumCase {
  std::string codec;
  SelectOn select = SelectOn::Host;  // Device: topk's, threshold's or onebit's pass on the GPU (DeviceSelect)
};
void PrintTo(const SumCase& c, std::ostream* out) {
  *out << c.codec << (c.select == SelectOn::Device ? " selected on the device" : "");
}

class GpuCodecSum : public ::testing::TestWithParam<SumCase> {};

// Each codec's CompressedSum on cuda:0 against the same on the CPU, 2 ranks as threads, 3 rounds of
// 2 buffers (one of several ring segments, one short): the sums (and the sparse codecs' residuals)
// are the CPU's bit for bit. The sparse codecs and none get the same inputs; fp16 and bf16 get, on
// the CPU, the inputs rounded to 16 bits, since on the device a rank's own values enter the ring as
// they crossed, in 16 bits (compressed.h). Before each start() the current stream is kept busy
// and the bucket is written after that (as autograd's hooks do): the copy to the host must wait
// for it. After each finish() the sum is read on the current stream: it must wait for the copy back.
TEST_P(GpuCodecSum, SumsOnTheDeviceEqualTheCpusBitForBit) {
  REQUIRE_GPU();
  const auto spec = compress::CodecSpec::parse(GetParam().codec);
  const std::vector<int64_t> lengths = {600001, 4099};
  constexpr int kRounds = 3;
  // [rank][round][buffer]
  std::vector<std::vector<std::vector<torch::Tensor>>> onCuda(2), onCpu(2);
  std::vector<std::vector<std::vector<float>>> cudaResiduals(2), cpuResiduals(2);
  test::onRanks(2, [&](std::shared_ptr<Communicator> comm) {
    const int rank = comm->rank();
    std::vector<std::vector<torch::Tensor>> inputs;
    for (int64_t n : lengths) inputs.push_back(makeRounds(rank, kRounds, n));
    {
      CompressedSum sum(comm, spec, lengths, kCuda, GetParam().select);
      std::vector<torch::Tensor> flats;
      for (int64_t n : lengths) flats.push_back(torch::zeros({n}, torch::TensorOptions().device(kCuda)));
      for (int round = 0; round < kRounds; ++round) {
        for (size_t b = 0; b < lengths.size(); ++b) {
          torch::Tensor source = inputs[b][size_t(round)].to(kCuda);
          keepTheStreamBusy();
          flats[b].copy_(source);
          sum.start(b, flats[b]);
        }
        std::vector<torch::Tensor> sums;
        for (size_t b = 0; b < lengths.size(); ++b) {
          sum.finish(b, flats[b]);
          sums.push_back(flats[b].cpu());
        }
        onCuda[size_t(rank)].push_back(sums);
      }
      for (size_t b = 0; b < lengths.size(); ++b) {
        auto residual = sum.residual(b);
        cudaResiduals[size_t(rank)].emplace_back(residual.begin(), residual.end());
      }
    }
    CompressedSum sum(comm, spec, lengths);
    for (int round = 0; round < kRounds; ++round) {
      std::vector<torch::Tensor> flats;
      for (size_t b = 0; b < lengths.size(); ++b) {
        torch::Tensor in = inputs[b][size_t(round)].clone();
        if (spec.kind == compress::CodecKind::Fp16) in = in.to(torch::kHalf).to(torch::kFloat32);
        if (spec.kind == compress::CodecKind::Bf16) in = in.to(torch::kBFloat16).to(torch::kFloat32);
        flats.push_back(in);
        sum.start(b, flats[b]);
      }
      for (size_t b = 0; b < lengths.size(); ++b) sum.finish(b, flats[b]);
      onCpu[size_t(rank)].push_back(flats);
    }
    for (size_t b = 0; b < lengths.size(); ++b) {
      auto residual = sum.residual(b);
      cpuResiduals[size_t(rank)].emplace_back(residual.begin(), residual.end());
    }
  });
  for (size_t r = 0; r < 2; ++r) {
    for (int round = 0; round < kRounds; ++round) {
      for (size_t b = 0; b < lengths.size(); ++b) {
        const auto& gpu = onCuda[r][size_t(round)][b];
        EXPECT_EQ(bitDifference(gpu, onCpu[r][size_t(round)][b]), "")
            << spec.text() << ", rank " << r << ", round " << round << ", buffer " << b << " (" << lengths[b]
            << " floats): cuda:0 against the CPU";
        EXPECT_EQ(bitDifference(gpu, onCuda[0][size_t(round)][b]), "")
            << spec.text() << ", round " << round << ", buffer " << b << ": rank " << r << " against rank 0 on cuda:0";
      }
    }
    for (size_t b = 0; b < lengths.size(); ++b) {
      const auto& gpu = cudaResiduals[r][b];
      const auto& cpu = cpuResiduals[r][b];
      ASSERT_EQ(gpu.size(), cpu.size()) << spec.text() << ": residual sizes, rank " << r << ", buffer " << b;
      if (gpu.empty()) continue;
      EXPECT_EQ(bitDifference(torch::tensor(gpu), torch::tensor(cpu)), "")
          << spec.text() << ": the residual after " << kRounds << " rounds, rank " << r << ", buffer " << b;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(EveryCodec, GpuCodecSum,
                         ::testing::Values(SumCase{"none"}, SumCase{"fp16"}, SumCase{"bf16"}, SumCase{"topk:0.1"},
                                           SumCase{"threshold:0.01"}, SumCase{"onebit"},
                                           SumCase{"topk:0.1", SelectOn::Device},
                                           SumCase{"threshold:0.01", SelectOn::Device},
                                           SumCase{"onebit", SelectOn::Device}),
                         [](const auto& info) {
                           std::string name =
                               info.param.codec + (info.param.select == SelectOn::Device ? "_on_device" : "");
                           for (char& c : name) {
                             if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
                           }
                           return name;
                         });

// --- cohort train: 2 processes sharing cuda:0 against 2 processes on the CPU ---

// How close the trained parameters must be, as fractions of the run's largest movement of a
// parameter (max |trained - initial| on the CPU, so that the bounds scale with what training did).
struct TrainCase {
  std::string codec;
  // At most kFewFraction of the elements differ by more than bulkOfMovement * movement.
  double bulkOfMovement;
  std::string environment;  // for the cuda run: "env COHORT_SPARSE_SELECT=device " or empty
};
// The elements allowed beyond the bulk's bound: a ReLU whose input is within rounding of zero may
// pass a sample's gradient on one device and not the other (a row of 784 or 512 weights), and an
// entry at the edge of a sparse codec's selection may be sent on one and kept on the other; a
// bucket exchanged wrongly (stale, unsynchronized, another rank's) moves far more (on the CPU,
// 39 to 89 % of the elements move by more than 1 % of the movement in these runs).
constexpr double kFewFraction = 0.005;
void PrintTo(const TrainCase& c, std::ostream* out) { *out << c.environment << c.codec; }

std::string train(const std::string& options) {
  return test::cohortBinary() + " train --progress off --timeout 60 " + options;
}

// The mlp (669,706 parameters: two buckets, of about 1 and 1.7 MB) on synthetic data, plain SGD,
// batch 16 per rank.
const std::string kCommon = "--model mlp --data synthetic:1200 --optimizer sgd --batch 16 --threads 1 ";

class GpuCodecTraining : public ::testing::TestWithParam<TrainCase> {
 protected:
  // The parameters before training: the same seed and model after one step of a learning rate
  // too small to change any float (1e-30 of a gradient is below half an ulp of every weight).
  static void SetUpTestSuite() {
    if (cudaDeviceCount() == 0) return;
    initialDir_ = new test::TempDir;
    auto r = test::runCommand(train(kCommon + "--lr 1e-30 --steps 1 --device cpu --save-model " +
                                    initialDir_->file("initial.pt")));
    initialOutput_ = r.exitCode == 0 ? "" : r.output;
  }
  static void TearDownTestSuite() {
    delete initialDir_;
    initialDir_ = nullptr;
  }
  static test::TempDir* initialDir_;
  static std::string initialOutput_;
};
test::TempDir* GpuCodecTraining::initialDir_ = nullptr;
std::string GpuCodecTraining::initialOutput_;

// What differs between two parameter lists, relative to `movement`: the largest difference and
// where, and how many elements differ by more than `over`.
std::string describe(const std::vector<torch::Tensor>& gpu, const std::vector<torch::Tensor>& cpu,
                     const std::vector<torch::Tensor>& initial, double over) {
  std::ostringstream out;
  double worst = -1;
  int64_t many = 0, all = 0;
  for (size_t i = 0; i < gpu.size() && i < cpu.size(); ++i) {
    const torch::Tensor d = (gpu[i] - cpu[i]).abs().flatten();
    many += d.gt(over).sum().item<int64_t>();
    all += d.numel();
    const int64_t at = d.argmax().item<int64_t>();
    if (d[at].item<double>() > worst) {
      worst = d[at].item<double>();
      out.str("");
      out << "largest |cuda - cpu| " << worst << " in parameter " << i << " " << gpu[i].sizes() << " at flat index "
          << at << " (cuda " << gpu[i].flatten()[at].item<float>() << ", cpu " << cpu[i].flatten()[at].item<float>()
          << ", initial " << initial[i].flatten()[at].item<float>() << ")";
    }
  }
  out << "; " << many << " of " << all << " elements differ by more than " << over;
  return out.str();
}

// Trains with the codec on cuda (2 ranks sharing cuda:0) and on the CPU (2 ranks), the same seed,
// data and steps. The replicas of each run are bit-identical; cuda and CPU agree within the case's
// tolerance (see the cases for why each).
TEST_P(GpuCodecTraining, TwoRanksOnCudaTrainAsTwoRanksOnTheCpu) {
  REQUIRE_GPU();
  ASSERT_NE(initialDir_, nullptr);
  ASSERT_EQ(initialOutput_, "") << "the run that saves the initial parameters failed";
  const TrainCase c = GetParam();
  test::TempDir dir;
  const std::string options = kCommon + "--steps 6 --lr 0.1 --strategy allreduce --codec " + c.codec + " ";
  auto gpuRun = test::runCommand(c.environment + test::launchPrefix(2) +
                                     train(options + "--device cuda --save-model " + dir.file("cuda{rank}.pt")),
                                 120);
  ASSERT_EQ(gpuRun.exitCode, 0) << c.codec << " on cuda:\n" << gpuRun.output;
  auto cpuRun = test::runCommand(test::launchPrefix(2) +
                                 train(options + "--device cpu --save-model " + dir.file("cpu{rank}.pt")), 120);
  ASSERT_EQ(cpuRun.exitCode, 0) << c.codec << " on the CPU:\n" << cpuRun.output;

  const auto initial = test::loadParameters(initialDir_->file("initial.pt"));
  const auto gpu0 = test::loadParameters(dir.file("cuda0.pt"));
  const auto gpu1 = test::loadParameters(dir.file("cuda1.pt"));
  const auto cpu0 = test::loadParameters(dir.file("cpu0.pt"));
  const auto cpu1 = test::loadParameters(dir.file("cpu1.pt"));
  ASSERT_EQ(gpu0.size(), initial.size());
  for (size_t i = 0; i < gpu0.size(); ++i) {
    EXPECT_EQ(bitDifference(gpu0[i], gpu1[i]), "") << c.codec << ": parameter " << i << ", cuda rank 0 against rank 1";
    EXPECT_EQ(bitDifference(cpu0[i], cpu1[i]), "") << c.codec << ": parameter " << i << ", cpu rank 0 against rank 1";
  }
  const double movement = test::maxDifference(cpu0, initial);
  ASSERT_GT(movement, 1e-4) << c.codec << ": training on the CPU barely moved the parameters; the comparison "
                            << "would show nothing";
  const double bound = c.bulkOfMovement * movement;
  const double fraction = test::fractionDifferent(gpu0, cpu0, bound);
  EXPECT_LE(fraction, kFewFraction) << c.codec << ": the largest parameter movement on the CPU is " << movement
                                    << "; " << describe(gpu0, cpu0, initial, bound);
  // Even those few within one movement: nothing diverged.
  EXPECT_LE(test::maxDifference(gpu0, cpu0), movement)
      << c.codec << ": the largest parameter movement on the CPU is " << movement << "; "
      << describe(gpu0, cpu0, initial, bound);
}

// The bulk's bounds. The runs differ by the GPU's float rounding (matrix products summed in other
// orders: relative differences of about 1e-6 in the gradients), which each codec turns into:
//   none   the same, grown over 6 steps: far below 1e-3 of the movement.
//   fp16   besides, a gradient entry may round to the neighbouring 16-bit value on one device and
//          not the other, and a rank's own values enter the ring rounded (compressed.h): an ulp
//          (2^-11 relative) of an entry's step, at most 6 steps: under 1e-2 of the movement.
//   bf16   the same with an ulp of 2^-8: under 5e-2.
//   topk:0.1, threshold:0.001, onebit   the rounding passes through (topk's values, onebit's
//          scales) or vanishes (threshold's +-tau), but for the few entries at the edge of the
//          selection: under 1e-2. (On the CPU, in these 6 steps, tau 0.001 moves 55 % of the
//          entries, topk 47 %, onebit all.)
std::string trainCaseName(const ::testing::TestParamInfo<TrainCase>& info) {
  std::string name = info.param.codec + (info.param.environment.empty() ? "" : "_on_device");
  for (char& c : name) {
    if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
  }
  return name;
}
INSTANTIATE_TEST_SUITE_P(EveryCodec, GpuCodecTraining,
                         ::testing::Values(TrainCase{"none", 1e-3}, TrainCase{"fp16", 1e-2}, TrainCase{"bf16", 5e-2},
                                           TrainCase{"topk:0.1", 1e-2}, TrainCase{"threshold:0.001", 1e-2},
                                           TrainCase{"onebit", 1e-2}),
                         trainCaseName);
// topk, threshold and onebit with their pass on the GPU: an instantiation of their own, so that
// scripts/gpu-check.sh gives them a process and a timeout of their own beside the six above.
INSTANTIATE_TEST_SUITE_P(SelectedOnDevice, GpuCodecTraining,
                         ::testing::Values(TrainCase{"topk:0.1", 1e-2, "env COHORT_SPARSE_SELECT=device "},
                                           TrainCase{"threshold:0.001", 1e-2, "env COHORT_SPARSE_SELECT=device "},
                                           TrainCase{"onebit", 1e-2, "env COHORT_SPARSE_SELECT=device "}),
                         trainCaseName);

}  // namespace
}  // namespace cohort::gpu_codec_test
