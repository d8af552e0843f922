// What needs a CUDA GPU (ctest label gpu; run by scripts/gpu-check.sh, never by CI). Without a GPU
// every test here fails at once, naming what is missing: a test that cannot run fails loudly.
#include <cohort/data_parallel.h>
#include <cohort/device.h>
#include <cohort/error.h>
#include <cohort/job.h>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <string>
#include <vector>

#include "rank_threads.h"
#include "test_util.h"

namespace cohort {
namespace {

using test::onRanks;

#define REQUIRE_GPU()                                                                                    \
  ASSERT_GT(cudaDeviceCount(), 0) << "this test needs a CUDA GPU and this process sees none (label gpu: " \
                                     "run it through scripts/gpu-check.sh on a machine that has one)"

std::string train(const std::string& options) {
  return test::cohortBinary() + " train --progress off --timeout 60 " + options;
}

double finalAccuracy(const std::string& metrics) { return test::lastEvent(metrics, "done")["accuracy"].get<double>(); }

// One process trains the cnn on cuda:0 to the accuracy it reaches on the CPU (same seed, data, steps;
// the GPU's kernels sum in other orders, so the runs differ by rounding, not by more).
TEST(Gpu, TheCnnTrainsOnCudaToTheAccuracyItReachesOnTheCpu) {
  REQUIRE_GPU();
  test::TempDir dir;
  const std::string common = "--model cnn --data fashion-mnist --steps 300 --batch 64 --seed 3 ";
  auto gpu = test::runCommand(train(common + "--device cuda:0 --metrics " + dir.path() + "/gpu.jsonl"));
  ASSERT_EQ(gpu.exitCode, 0) << gpu.output;
  auto cpu = test::runCommand(train(common + "--device cpu --metrics " + dir.path() + "/cpu.jsonl"));
  ASSERT_EQ(cpu.exitCode, 0) << cpu.output;
  const double onGpu = finalAccuracy(dir.path() + "/gpu.jsonl");
  const double onCpu = finalAccuracy(dir.path() + "/cpu.jsonl");
  EXPECT_GT(onCpu, 0.7);
  EXPECT_NEAR(onGpu, onCpu, 0.02) << "cuda " << onGpu << ", cpu " << onCpu;
}

// A checkpoint written on the GPU resumes on the CPU, and one written there resumes on the GPU.
TEST(Gpu, ACheckpointWrittenOnEitherDeviceResumesOnTheOther) {
  REQUIRE_GPU();
  for (const auto& [first, second] : {std::pair{"cuda", "cpu"}, std::pair{"cpu", "cuda"}}) {
    test::TempDir dir;
    const std::string common = "--model cnn --data synthetic:2000 --batch 32 --checkpoint-every 10 --checkpoint-dir " +
                               dir.path() + " --metrics " + dir.path() + "/m.jsonl ";
    auto a = test::runCommand(train(common + "--steps 20 --device " + first));
    ASSERT_EQ(a.exitCode, 0) << a.output;
    auto b = test::runCommand(train(common + "--steps 40 --resume --device " + second));
    ASSERT_EQ(b.exitCode, 0) << first << " -> " << second << ": " << b.output;
    EXPECT_NE(b.output.find("step 20"), std::string::npos) << b.output;
    EXPECT_EQ(test::lastEvent(dir.path() + "/m.jsonl", "done")["steps"].get<int64_t>(), 40) << b.output;
  }
}

// Two ranks sharing cuda:0 (Gloo over CUDA tensors) equal one process with twice the batch, and
// their replicas stay bit-identical.
TEST(Gpu, DataParallelOnCudaEqualsOneProcessWithTheCombinedBatch) {
  REQUIRE_GPU();
  const torch::Device cuda(torch::kCUDA, 0);
  const int world = 2;
  const int64_t b = 16;
  const int steps = 5;
  torch::manual_seed(5);
  const torch::Tensor x = torch::randn({world * b * steps, 20}).to(cuda);
  const torch::Tensor y = torch::randint(0, 5, {world * b * steps}, torch::kInt64).to(cuda);
  auto makeNet = [] { return torch::nn::Sequential(torch::nn::Linear(20, 64), torch::nn::ReLU(), torch::nn::Linear(64, 5)); };
  torch::manual_seed(1);
  auto init = makeNet();
  auto snapshot = [](torch::nn::Sequential& n) {
    std::vector<torch::Tensor> out;
    for (auto& p : n->parameters()) out.push_back(p.detach().to(torch::kCPU).clone());
    return out;
  };
  auto reference = makeNet();
  {
    torch::NoGradGuard g;
    for (size_t i = 0; i < reference->parameters().size(); ++i) reference->parameters()[i].copy_(init->parameters()[i]);
  }
  reference->to(cuda);
  torch::optim::SGD refOpt(reference->parameters(), 0.1);
  for (int s = 0; s < steps; ++s) {
    refOpt.zero_grad();
    auto slice = torch::indexing::Slice(s * world * b, (s + 1) * world * b);
    torch::nn::functional::cross_entropy(reference->forward(x.index({slice})), y.index({slice})).backward();
    refOpt.step();
  }
  const auto expected = snapshot(reference);
  std::vector<std::vector<torch::Tensor>> finals(world);
  onRanks(world, [&](std::shared_ptr<Communicator> comm) {
    const int r = comm->rank();
    auto net = makeNet();
    if (r == 0) {
      torch::NoGradGuard g;
      for (size_t i = 0; i < net->parameters().size(); ++i) net->parameters()[i].copy_(init->parameters()[i]);
    }
    net->to(cuda);
    torch::optim::SGD opt(net->parameters(), 0.1);
    DataParallel dp(Job::fromCommunicator(comm), *net, {.bucketMb = 0.005});
    for (int s = 0; s < steps; ++s) {
      opt.zero_grad();
      // Rank r takes rows r, r + 2, ... of the step's combined batch.
      auto idx = torch::arange(s * world * b + r, (s + 1) * world * b, world, torch::kInt64).to(cuda);
      torch::nn::functional::cross_entropy(net->forward(x.index_select(0, idx)), y.index_select(0, idx)).backward();
      opt.step();
    }
    EXPECT_EQ(dp.stats().syncSteps, steps);
    finals[size_t(r)] = snapshot(net);
  });
  for (size_t i = 0; i < expected.size(); ++i) {
    EXPECT_TRUE(torch::equal(finals[0][i], finals[1][i])) << "replicas differ at tensor " << i;
    EXPECT_TRUE(torch::allclose(finals[0][i], expected[i], 1e-5, 1e-5))
        << "tensor " << i << " differs from one process by " << (finals[0][i] - expected[i]).abs().max().item<float>();
  }
}

// cohort train --strategy allreduce with 2 ranks on the GPU(s) of this machine.
TEST(Gpu, AllreduceTrainsOnCudaUnderCohortLaunch) {
  REQUIRE_GPU();
  test::TempDir dir;
  auto r = test::runCommand(test::launchPrefix(2) + train("--strategy allreduce --model cnn --data synthetic:4000 "
                                                          "--steps 60 --device cuda --metrics " + dir.path() + "/m.jsonl"));
  ASSERT_EQ(r.exitCode, 0) << r.output;
  EXPECT_EQ(test::lastEvent(dir.path() + "/m.jsonl", "done")["steps"].get<int64_t>(), 60) << r.output;
}

TEST(Gpu, BadDeviceRequestsAreOneLineEach) {
  REQUIRE_GPU();
  const std::string base = "--model mlp --data synthetic:200 --steps 2 ";
  auto hogwild = test::runCommand(train(base + "--strategy hogwild --device cuda"));
  EXPECT_EQ(hogwild.exitCode, 2) << hogwild.output;
  EXPECT_NE(hogwild.output.find("--strategy hogwild is a CPU scheme"), std::string::npos) << hogwild.output;
  auto past = test::runCommand(train(base + "--device cuda:" + std::to_string(cudaDeviceCount())));
  EXPECT_EQ(past.exitCode, 2) << past.output;
  EXPECT_NE(past.output.find("this process sees " + std::to_string(cudaDeviceCount()) + " CUDA device"),
            std::string::npos)
      << past.output;
  // A codec on a CUDA model is refused by the handle until the codecs run on devices.
  torch::nn::Sequential net(torch::nn::Linear(4, 3));
  net->to(torch::Device(torch::kCUDA, 0));
  EXPECT_THROW(DataParallel(Job::single(), *net, {.codec = "fp16"}), InvalidArgument);
}

}  // namespace
}  // namespace cohort
