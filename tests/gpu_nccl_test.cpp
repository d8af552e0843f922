// The NCCL backend on one GPU (ctest label gpu; scripts/gpu-check.sh runs it, CI never does).
// NCCL at world size 1 is a real one-rank NCCL communicator: the same code path as on many GPUs
// (group formation, launch, cohort's wait), which is what one GPU can show. Two ranks on one GPU
// cannot form an NCCL communicator: backend nccl refuses them, auto falls back to Gloo. The tests
// with two GPUs are in multigpu_nccl_test.cpp. Without a GPU every test here fails at once.
#include <cohort/comm_backend.h>
#include <cohort/communicator.h>
#include <cohort/data_parallel.h>
#include <cohort/device.h>
#include <cohort/error.h>
#include <cohort/job.h>

#include <ATen/cuda/Sleep.h>
#include <c10/cuda/CUDAStream.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <sstream>
#include <string>
#include <vector>

#include "model_util.h"
#include "rank_threads.h"
#include "gpu_util.h"
#include "test_util.h"

namespace cohort::gpu_nccl_test {
namespace {

const torch::Device kGpu(torch::kCUDA, 0);

std::shared_ptr<Communicator> alone(CommBackend backend) {
  ClusterSpec spec;
  spec.master = {"127.0.0.1", 0};
  return Communicator::connect(spec, {.timeout = std::chrono::seconds(30), .backend = backend});
}

std::string train(const std::string& options) {
  return test::cohortBinary() + " train --progress off --timeout 60 " + options;
}

// allreduce, async allreduces, broadcast, allgather and allgatherVariable of CUDA tensors through a
// one-rank NCCL group: the values and the device are what they were (a sum over one rank), and a
// CPU collective between them (Gloo) still works.
TEST(GpuNccl, CollectivesOfCudaTensorsAtWorldSizeOne) {
  REQUIRE_GPU();
  REQUIRE_NCCL();
  auto comm = alone(CommBackend::kNccl);
  EXPECT_EQ(comm->cudaBackend(), CommBackend::kAuto) << "chosen before any CUDA collective";

  const auto expected = torch::arange(1000, torch::TensorOptions().dtype(torch::kFloat32).device(kGpu));
  auto t = expected.clone();
  comm->allreduce(t);
  ASSERT_EQ(comm->cudaBackend(), CommBackend::kNccl) << "backend chosen: " << commBackendName(comm->cudaBackend());
  EXPECT_EQ(t.device(), kGpu);
  EXPECT_TRUE(torch::equal(t, expected)) << "allreduce over one rank changed the tensor: " << test::showTensor(t);

  std::vector<torch::Tensor> ts;
  std::vector<CommWork> works;
  for (int i = 0; i < 4; ++i) {
    ts.push_back(torch::full({257 * (i + 1)}, float(i + 1), torch::TensorOptions().device(kGpu)));
    works.push_back(comm->allreduceAsync(ts.back()));
  }
  for (auto& w : works) w.wait();
  for (int i = 0; i < 4; ++i) {
    EXPECT_TRUE(torch::all(ts[size_t(i)] == float(i + 1)).item<bool>()) << "async allreduce " << i << ": "
                                                                         << test::showTensor(ts[size_t(i)]);
  }

  auto onCpu = torch::full({8}, 5.0f);
  comm->allreduce(onCpu);  // Gloo
  EXPECT_TRUE(torch::all(onCpu == 5.0f).item<bool>()) << test::showTensor(onCpu);

  auto b = expected.clone();
  comm->broadcast(b, 0);
  EXPECT_TRUE(torch::equal(b, expected)) << "broadcast: " << test::showTensor(b);

  auto gathered = comm->allgather(expected.view({10, 100}));
  ASSERT_EQ(gathered.size(), 1u);
  EXPECT_EQ(gathered[0].device(), kGpu);
  EXPECT_TRUE(torch::equal(gathered[0], expected.view({10, 100}))) << "allgather: " << test::showTensor(gathered[0]);

  auto variable = comm->allgatherVariable(expected.narrow(0, 0, 37));
  ASSERT_EQ(variable.size(), 1u);
  EXPECT_TRUE(torch::equal(variable[0], expected.narrow(0, 0, 37))) << "allgatherVariable: " << test::showTensor(variable[0]);
  EXPECT_EQ(comm->counters().bytesSent, 0) << "one rank puts nothing on the wire";
  EXPECT_EQ(comm->cudaBackend(), CommBackend::kNccl);
}

// cohort waits for NCCL as the DDP reducer does: wait() makes the current stream wait for NCCL's and
// returns while the collective is still queued behind the GPU's work (no host synchronization per
// bucket); what the stream does next sees the result, and the communicator's watchdog sees it end.
TEST(GpuNccl, AWaitOrdersTheStreamAndLeavesTheHostFree) {
  REQUIRE_GPU();
  REQUIRE_NCCL();
  auto comm = alone(CommBackend::kNccl);
  auto t = torch::ones({1 << 20}, torch::TensorOptions().device(kGpu));
  comm->allreduce(t);  // forms the group
  // Every kernel used below once first: loading a kernel lazily (CUDA_MODULE_LOADING=LAZY, CUDA's
  // default) can synchronize the context, which would wait for the sleep on the host.
  t.mul_(1).add_(0);
  ASSERT_TRUE(torch::all(t == 1.0f).item<bool>());
  using Clock = std::chrono::steady_clock;
  auto ms = [](Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double, std::milli>(b - a).count(); };
  const auto t0 = Clock::now();
  at::cuda::sleep(int64_t(2'000'000'000));  // about a second of the GPU's time, on the current stream
  t.mul_(2);
  const bool pendingBefore = !c10::cuda::getCurrentCUDAStream(0).query();
  const auto t1 = Clock::now();
  CommWork work = comm->allreduceAsync(t);
  const auto t2 = Clock::now();
  work.wait();
  const auto t3 = Clock::now();
  const bool completed = work.isCompleted();
  const auto t4 = Clock::now();
  std::cout << "sleep+mul " << ms(t0, t1) << " ms (stream busy: " << pendingBefore << "), launch " << ms(t1, t2)
            << " ms, wait " << ms(t2, t3) << " ms, isCompleted " << ms(t3, t4) << " ms" << std::endl;
  ASSERT_TRUE(pendingBefore) << "the GPU finished its sleep before the collective was launched: something on the "
                                "host waited for it before the collective (a kernel loaded lazily?)";
  EXPECT_FALSE(completed) << "wait() held the host until the GPU had finished the collective";
  t.add_(1);
  EXPECT_TRUE(torch::all(t == 3.0f).item<bool>()) << test::showTensor(t);
  EXPECT_TRUE(work.isCompleted());
  comm->barrier();  // waits for the watchdog to see every NCCL work end: none failed
}

// auto picks NCCL for a rank alone on its GPU; gloo keeps CUDA tensors on Gloo.
TEST(GpuNccl, AutoChoosesNcclAndGlooStaysGloo) {
  REQUIRE_GPU();
  REQUIRE_NCCL();
  for (auto [backend, chosen] : {std::pair{CommBackend::kAuto, CommBackend::kNccl},
                                 std::pair{CommBackend::kGloo, CommBackend::kGloo}}) {
    auto comm = alone(backend);
    auto t = torch::full({64}, 3.0f, torch::TensorOptions().device(kGpu));
    comm->allreduce(t);
    EXPECT_EQ(comm->cudaBackend(), chosen) << "backend " << commBackendName(backend) << " chose "
                                           << commBackendName(comm->cudaBackend());
    EXPECT_TRUE(torch::all(t == 3.0f).item<bool>()) << commBackendName(backend) << ": " << test::showTensor(t);
  }
}

// Two ranks (threads) on one GPU: NCCL cannot have them. Under nccl both throw InvalidArgument
// naming the ranks and the fix; under auto both fall back to Gloo and the sum is right.
TEST(GpuNccl, RanksSharingAGpuAreRefusedByNcclAndFallBackToGlooUnderAuto) {
  REQUIRE_GPU();
  REQUIRE_NCCL();
  test::onRanks(
      2,
      [&](std::shared_ptr<Communicator> comm) {
        auto t = torch::ones({16}, torch::TensorOptions().device(kGpu));
        try {
          comm->allreduce(t);
          ADD_FAILURE() << "rank " << comm->rank() << ": backend nccl over one GPU shared by 2 ranks went through ("
                        << commBackendName(comm->cudaBackend()) << "), expected InvalidArgument";
        } catch (const InvalidArgument& e) {
          const std::string what = e.what();
          EXPECT_NE(what.find("ranks 0 and 1 use one GPU (cuda:0"), std::string::npos) << what;
          EXPECT_NE(what.find("give each rank a GPU of its own"), std::string::npos) << what;
        }
      },
      std::chrono::seconds(30), CommBackend::kNccl);
  test::onRanks(
      2,
      [&](std::shared_ptr<Communicator> comm) {
        auto t = torch::full({16}, float(comm->rank() + 1), torch::TensorOptions().device(kGpu));
        comm->allreduce(t);
        EXPECT_EQ(comm->cudaBackend(), CommBackend::kGloo) << "rank " << comm->rank();
        EXPECT_TRUE(torch::all(t == 3.0f).item<bool>()) << "rank " << comm->rank() << ": " << test::showTensor(t);
      },
      std::chrono::seconds(30), CommBackend::kAuto);
}

// `cohort train --strategy allreduce --backend nccl --device cuda` in one process (a group of one):
// it trains, says so in the done event, and ends where --backend gloo ends (the same kernels; a sum
// over one rank is the tensor itself).
TEST(GpuNccl, TrainWithBackendNcclEqualsBackendGloo) {
  REQUIRE_GPU();
  REQUIRE_NCCL();
  test::TempDir dir;
  const std::string common = "--strategy allreduce --device cuda --model mlp --data synthetic:1200 --optimizer sgd "
                             "--lr 0.1 --batch 32 --steps 20 --seed 5 --threads 1 ";
  for (const std::string backend : {"nccl", "gloo"}) {
    auto r = test::runCommand(train(common + "--backend " + backend + " --save-model " + dir.file(backend + ".pt") +
                                    " --metrics " + dir.file(backend + ".jsonl")));
    ASSERT_EQ(r.exitCode, 0) << backend << ": " << r.output;
    const auto done = test::lastEvent(dir.file(backend + ".jsonl"), "done");
    EXPECT_EQ(done["backend"], backend) << done.dump();
    EXPECT_EQ(done["steps"].get<int64_t>(), 20) << done.dump();
  }
  const auto nccl = test::loadParameters(dir.file("nccl.pt"));
  const auto gloo = test::loadParameters(dir.file("gloo.pt"));
  ASSERT_EQ(nccl.size(), gloo.size());
  EXPECT_LT(test::maxDifference(nccl, gloo), 1e-5) << "parameters after 20 steps, nccl against gloo";
  const double lossNccl = test::lastEvent(dir.file("nccl.jsonl"), "done")["test_loss"].get<double>();
  const double lossGloo = test::lastEvent(dir.file("gloo.jsonl"), "done")["test_loss"].get<double>();
  EXPECT_NEAR(lossNccl, lossGloo, 1e-4) << "test loss, nccl " << lossNccl << ", gloo " << lossGloo;
}

// Two processes on cuda:0 under cohort launch: --backend nccl ends in one line naming the ranks
// and the fix; --backend auto trains through Gloo and says so.
TEST(GpuNccl, TwoProcessesOnOneGpuUnderLaunch) {
  REQUIRE_GPU();
  REQUIRE_NCCL();
  test::TempDir dir;
  const std::string common = "--strategy allreduce --device cuda:0 --model mlp --data synthetic:600 --steps 4 ";
  auto refused = test::runCommand(test::launchPrefix(2) + train(common + "--backend nccl"));
  EXPECT_NE(refused.exitCode, 0) << refused.output;
  EXPECT_NE(refused.output.find("use one GPU (cuda:0"), std::string::npos) << refused.output;
  EXPECT_NE(refused.output.find("give each rank a GPU of its own"), std::string::npos) << refused.output;
  auto fallback = test::runCommand(test::launchPrefix(2) +
                                   train(common + "--backend auto --metrics " + dir.file("m.jsonl")));
  ASSERT_EQ(fallback.exitCode, 0) << fallback.output;
  EXPECT_EQ(test::lastEvent(dir.file("m.jsonl"), "done")["backend"], "gloo") << fallback.output;
  EXPECT_NE(fallback.output.find("collectives over CUDA tensors go through Gloo"), std::string::npos)
      << fallback.output;
}

// A small net of `dtype` on cuda:0 after 3 momentum-SGD steps on fixed batches: under
// DataParallel over `comm` (a group of one) when given, else the plain loop. Its parameters, on
// the CPU in float64.
std::vector<torch::Tensor> trainInDtype(torch::Dtype dtype, const std::shared_ptr<Communicator>& comm) {
  torch::manual_seed(3);
  torch::nn::Sequential net(torch::nn::Linear(12, 32), torch::nn::ReLU(), torch::nn::Linear(32, 5));
  net->to(kGpu, dtype);
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  std::unique_ptr<DataParallel> dp;
  if (comm != nullptr) dp = std::make_unique<DataParallel>(Job::fromCommunicator(comm), *net);
  torch::manual_seed(4);
  for (int s = 0; s < 3; ++s) {
    const auto x = torch::randn({16, 12}).to(kGpu, dtype);
    const auto y = torch::randint(0, 5, {16}).to(kGpu);
    opt.zero_grad();
    torch::nn::functional::cross_entropy(net->forward(x), y).backward();
    opt.step();
  }
  std::vector<torch::Tensor> out;
  for (const auto& p : net->parameters()) {
    EXPECT_EQ(p.device(), kGpu);
    EXPECT_EQ(p.scalar_type(), dtype);
    out.push_back(p.detach().to(torch::kCPU, torch::kFloat64));
  }
  return out;
}

// DataParallel's buckets in bfloat16 and float64 on cuda:0, through a one-rank NCCL group and a
// one-rank Gloo group (which stages CUDA tensors through host memory): the model keeps its dtype
// and device and ends where the plain loop on the same GPU ends (a sum over one rank is the
// gradient itself; the tolerance is one bfloat16 rounding of values of order 0.1 to 1, in case
// the two runs' kernels round apart).
TEST(GpuNccl, Bfloat16AndFloat64BucketsOnCudaEqualThePlainLoop) {
  REQUIRE_GPU();
  REQUIRE_NCCL();
  for (const auto dtype : {torch::kBFloat16, torch::kFloat64}) {
    const auto loop = trainInDtype(dtype, nullptr);
    for (const auto backend : {CommBackend::kNccl, CommBackend::kGloo}) {
      SCOPED_TRACE(std::string(c10::toString(dtype)) + " through " + commBackendName(backend));
      auto comm = alone(backend);
      const auto got = trainInDtype(dtype, comm);
      EXPECT_EQ(comm->cudaBackend(), backend) << commBackendName(comm->cudaBackend());
      EXPECT_LT(test::maxDifference(got, loop), dtype == torch::kFloat64 ? 1e-12 : 4e-3);
    }
    torch::manual_seed(3);
    torch::nn::Sequential start(torch::nn::Linear(12, 32), torch::nn::ReLU(), torch::nn::Linear(32, 5));
    std::vector<torch::Tensor> before;
    for (const auto& p : start->parameters()) before.push_back(p.detach().to(torch::kFloat64));
    EXPECT_GT(test::maxDifference(before, loop), 1e-2) << "training did not move the parameters";
  }
}

}  // namespace
}  // namespace cohort::gpu_nccl_test
