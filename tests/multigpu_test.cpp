// What needs two or more CUDA GPUs (ctest label multigpu): in-process replicas on different GPUs,
// one per GPU as TensorFlow's MirroredStrategy. With fewer than two GPUs every test fails at once,
// saying how many it saw: a test that cannot run fails loudly, it never skips.
#include <cohort/device.h>
#include <cohort/replicas.h>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <sstream>
#include <string>
#include <vector>

#include "gpu_util.h"
#include "model_util.h"

namespace cohort::multigpu_test {
namespace {

using test::maxDifference;

std::vector<torch::Tensor> onCpu(const std::vector<torch::Tensor>& tensors) {
  std::vector<torch::Tensor> out;
  for (const auto& t : tensors) out.push_back(t.detach().to(torch::kCPU).clone());
  return out;
}

torch::nn::Sequential smallNet(uint64_t seed) {
  torch::manual_seed(seed);
  return torch::nn::Sequential(torch::nn::Linear(12, 32), torch::nn::ReLU(), torch::nn::Linear(32, 5));
}

const ShardLoss kLoss = [](int, torch::nn::Module& m, const torch::Tensor& x, const torch::Tensor& y) {
  return torch::nn::functional::cross_entropy(m.as<torch::nn::SequentialImpl>()->forward(x), y);
};

struct Trained {
  std::vector<std::vector<torch::Tensor>> replicas;  // every replica's parameters, on the CPU
  std::vector<std::string> devices;                  // every replica's device
};

// R replicas of the small net (its model on `device`), 6 steps of momentum SGD on batches of 13
// (uneven shards), the batches given on the CPU.
Trained train(bool central, int R, const torch::Device& device) {
  torch::manual_seed(11);
  std::vector<torch::Tensor> xs, ys;
  for (int i = 0; i < 6; ++i) {
    xs.push_back(torch::randn({13, 12}));
    ys.push_back(torch::randint(0, 5, {13}));
  }
  auto net = smallNet(5);
  net->to(device);
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  std::unique_ptr<ReplicaGroup> group;
  const ReplicaOptions options{.replicas = R, .bucketMb = 0.0005};
  if (central) {
    group = std::make_unique<CentralStorage>(net.ptr(), opt, options);
  } else {
    group = std::make_unique<Mirrored>(net.ptr(), opt, options);
  }
  for (size_t i = 0; i < xs.size(); ++i) group->step(xs[i], ys[i], kLoss);
  Trained run;
  for (int r = 0; r < R; ++r) {
    run.replicas.push_back(onCpu(group->replica(r).parameters()));
    run.devices.push_back(group->replica(r).parameters()[0].device().str());
  }
  return run;
}

std::string list(const std::vector<std::string>& items) {
  std::ostringstream out;
  for (size_t i = 0; i < items.size(); ++i) out << (i ? ", " : "") << items[i];
  return out.str();
}

// Mirrored with 2 replicas, the model on cuda:0: replica 1 is on cuda:1; the gradients are summed
// on cuda:0 and copied back; the run equals the CPU run within 1e-5 (the kernels' summation order,
// ~1e-7 relative per operation over 6 steps) and the two copies, on two GPUs of one kind running
// the same kernels on the same sums, are bit-identical.
TEST(MultiGpu, MirroredPutsOneReplicaOnEachGpuAndEqualsTheCpuRun) {
  REQUIRE_TWO_GPUS();
  const Trained cpu = train(false, 2, torch::Device(torch::kCPU));
  const Trained gpu = train(false, 2, torch::Device(torch::kCUDA, 0));
  EXPECT_EQ(gpu.devices, (std::vector<std::string>{"cuda:0", "cuda:1"})) << list(gpu.devices);
  EXPECT_LT(maxDifference(cpu.replicas[0], gpu.replicas[0]), 1e-5)
      << "cpu against replica 0 on " << gpu.devices[0] << ": max difference "
      << maxDifference(cpu.replicas[0], gpu.replicas[0]);
  EXPECT_EQ(maxDifference(gpu.replicas[0], gpu.replicas[1]), 0.0)
      << "replica 0 on " << gpu.devices[0] << " and replica 1 on " << gpu.devices[1]
      << " differ: max difference " << maxDifference(gpu.replicas[0], gpu.replicas[1]);
}

// Three replicas over the GPUs (cuda:0, cuda:1, then cuda:2 or cuda:0 again on two): the uneven
// shards (5, 4, 4) and the wrap-around equal the CPU run.
TEST(MultiGpu, MirroredWithMoreReplicasThanGpusWrapsAroundAndEqualsTheCpuRun) {
  REQUIRE_TWO_GPUS();
  const Trained cpu = train(false, 3, torch::Device(torch::kCPU));
  const Trained gpu = train(false, 3, torch::Device(torch::kCUDA, 0));
  const std::string third = "cuda:" + std::to_string(2 % cudaDeviceCount());
  EXPECT_EQ(gpu.devices, (std::vector<std::string>{"cuda:0", "cuda:1", third})) << list(gpu.devices);
  EXPECT_LT(maxDifference(cpu.replicas[0], gpu.replicas[0]), 1e-5)
      << "max difference " << maxDifference(cpu.replicas[0], gpu.replicas[0]);
  for (int r = 1; r < 3; ++r) {
    EXPECT_EQ(maxDifference(gpu.replicas[0], gpu.replicas[size_t(r)]), 0.0)
        << "replica " << r << " on " << gpu.devices[size_t(r)] << " differs from replica 0: max difference "
        << maxDifference(gpu.replicas[0], gpu.replicas[size_t(r)]);
  }
}

// CentralStorage with 2 replicas: the parameters on cuda:0, replica 1 computing on cuda:1 against a
// copy of them refreshed at the start of each step. The central set (replica 0's) equals the CPU
// run; replica 1's copy holds the parameters before the last update, so it is not compared.
TEST(MultiGpu, CentralStorageComputesOnEachGpuAndEqualsTheCpuRun) {
  REQUIRE_TWO_GPUS();
  const Trained cpu = train(true, 2, torch::Device(torch::kCPU));
  const Trained gpu = train(true, 2, torch::Device(torch::kCUDA, 0));
  EXPECT_EQ(gpu.devices, (std::vector<std::string>{"cuda:0", "cuda:1"})) << list(gpu.devices);
  EXPECT_LT(maxDifference(cpu.replicas[0], gpu.replicas[0]), 1e-5)
      << "max difference " << maxDifference(cpu.replicas[0], gpu.replicas[0]);
}

}  // namespace
}  // namespace cohort::multigpu_test
