// ParameterAveraging, the parameter-server client and Gossip with the model on a CUDA device (ctest
// label gpu; run by scripts/gpu-check.sh, never by CI). Each runs the same small job on cuda and on
// the CPU and compares them; without a GPU every test fails at once, naming what is missing.
//
// The tolerance between a cuda run and a CPU run: the two devices sum in different orders (cuBLAS
// against the CPU's GEMM, reductions in other trees), so the parameters differ by float32 rounding,
// ~1e-7 relative per operation, grown over a few SGD steps to ~1e-6; a ReLU input at zero may flip
// and move one element further. What the tests guard against moves far more: a lost average, a
// gradient not pushed or a copy that did not come back leaves a replica lr x gradient apart
// (~1e-2 here). So, as tests/gpu_test.cpp's DataParallel comparison: every element within 1e-3,
// and all but 1 % within 1e-5.
#include <cohort/averaging.h>
#include <cohort/device.h>
#include <cohort/job.h>
#include <cohort/parameter_server.h>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <cmath>
#include <sstream>
#include <string>
#include <vector>

#include "gossip_handle.h"
#include "gpu_util.h"
#include "model_util.h"
#include "ps/service.h"
#include "rank_threads.h"
#include "test_util.h"

namespace cohort::gpu_sync_test {
namespace {

constexpr double kMaxDifference = 1e-3;
constexpr double kElementTolerance = 1e-5;
constexpr double kFractionOver = 0.01;

std::string train(const std::string& options) {
  return test::cohortBinary() + " train --progress off --timeout 60 --threads 1 " + options;
}

// A saved model's parameters on the CPU (a model saved from cuda loads onto cuda).
// The element where two parameter lists differ most, for the failure message.
std::string worstElement(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  std::ostringstream out;
  double worst = -1;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    if (!a[i].sizes().equals(b[i].sizes())) return "parameter " + std::to_string(i) + " differs in shape";
    const torch::Tensor d = (a[i] - b[i]).abs().reshape({-1});
    const int64_t at = d.argmax().item<int64_t>();
    if (d[at].item<double>() > worst) {
      worst = d[at].item<double>();
      out.str("");
      out << "parameter " << i << " " << a[i].sizes() << " element " << at << ": " << a[i].reshape({-1})[at].item<double>()
          << " against " << b[i].reshape({-1})[at].item<double>();
    }
  }
  return out.str();
}

// Every parameter of two runs equal within the tolerances above, with what differed on failure.
void expectClose(const std::vector<torch::Tensor>& cuda, const std::vector<torch::Tensor>& cpu, const std::string& what) {
  ASSERT_EQ(cuda.size(), cpu.size()) << what;
  const double worst = test::maxDifference(cuda, cpu);
  const double over = test::fractionDifferent(cuda, cpu, kElementTolerance);
  EXPECT_LT(worst, kMaxDifference) << what << ": cuda against cpu, largest difference " << worst << " at "
                                   << worstElement(cuda, cpu);
  EXPECT_LT(over, kFractionOver) << what << ": " << over * 100 << " % of the elements differ by more than "
                                 << kElementTolerance << " (largest " << worst << " at " << worstElement(cuda, cpu) << ")";
}

void expectIdenticalReplicas(const std::vector<torch::Tensor>& rank0, const std::vector<torch::Tensor>& rank1,
                             const std::string& what) {
  ASSERT_EQ(rank0.size(), rank1.size()) << what;
  for (size_t i = 0; i < rank0.size(); ++i) {
    EXPECT_TRUE(torch::equal(rank0[i], rank1[i]))
        << what << ": the replicas differ in parameter " << i << " by up to "
        << (rank0[i] - rank1[i]).abs().max().item<double>() << " (" << worstElement({rank0[i]}, {rank1[i]}) << ")";
  }
}

// A run's done event (the chief's), its last step's loss, and whether it trained on cuda (the done
// event names the GPU memory it used only then).
struct Outcome {
  nlohmann::json done;
  double lastLoss = NAN;
  std::string summary() const {
    std::ostringstream out;
    out << "steps " << done.value("steps", int64_t(-1)) << ", test accuracy " << done.value("test_accuracy", -1.0)
        << ", last loss " << lastLoss << ", cuda_peak_bytes "
        << (done.contains("cuda_peak_bytes") ? done["cuda_peak_bytes"].dump() : std::string("absent (not on cuda)"));
    return out.str();
  }
};

Outcome outcome(const std::string& metrics) {
  Outcome o;
  o.done = test::lastEvent(metrics, "done");
  const nlohmann::json step = test::lastEvent(metrics, "step");
  if (step.contains("loss")) o.lastLoss = step["loss"].get<double>();
  return o;
}

// Runs `command` on cuda and on the CPU (`{device}` and `{run}` replaced) and checks that both
// finished, the cuda run on cuda. Returns their outcomes, cuda first.
std::pair<Outcome, Outcome> runBoth(const test::TempDir& dir, const std::string& command, int steps) {
  std::pair<Outcome, Outcome> out;
  for (const std::string device : {"cuda", "cpu"}) {
    std::string c = command;
    for (const std::string key : {"{device}", "{run}"}) {
      for (auto at = c.find(key); at != std::string::npos; at = c.find(key)) c.replace(at, key.size(), device);
    }
    c += " --metrics " + dir.file(device + ".jsonl");
    auto r = test::runCommand(c, 120);
    EXPECT_EQ(r.exitCode, 0) << "--device " << device << ": " << c << "\n" << r.output;
    if (r.exitCode != 0) return out;
    Outcome o = outcome(dir.file(device + ".jsonl"));
    EXPECT_EQ(o.done.value("steps", int64_t(-1)), steps) << "--device " << device << ": " << o.summary() << "\n" << r.output;
    EXPECT_EQ(o.done.contains("cuda_peak_bytes"), device == "cuda")
        << "--device " << device << ": trained on the wrong device: " << o.summary() << "\n" << r.output;
    (device == "cuda" ? out.first : out.second) = o;
  }
  return out;
}

// `--strategy average` with 2 ranks sharing cuda:0 equals the same job on the CPU, and its replicas
// are bit-identical after the final average (both copy the same host-averaged values back). 9 steps
// with period 2: four averages in the loop, the fifth in the final synchronize().
TEST(GpuSync, AveragingOnCudaEqualsTheCpuRunWithIdenticalReplicas) {
  REQUIRE_GPU();
  test::TempDir dir;
  const std::string command =
      test::launchPrefix(2) + train("--model mlp --data synthetic:1200 --optimizer momentum --lr 0.1 --batch 8 --steps 9 "
                                    "--strategy average --period 2 --average-optimizer-state --device {device} "
                                    "--save-model " + dir.file("{run}{rank}.pt"));
  auto [cuda, cpu] = runBoth(dir, command, 9);
  if (HasFailure()) return;
  const auto cuda0 = test::loadParameters(dir.file("cuda0.pt")), cuda1 = test::loadParameters(dir.file("cuda1.pt"));
  const auto cpu0 = test::loadParameters(dir.file("cpu0.pt")), cpu1 = test::loadParameters(dir.file("cpu1.pt"));
  expectIdenticalReplicas(cuda0, cuda1, "average on cuda");
  expectIdenticalReplicas(cpu0, cpu1, "average on the cpu");
  expectClose(cuda0, cpu0, "average, rank 0");
  EXPECT_NEAR(cuda.lastLoss, cpu.lastLoss, 1e-3) << "cuda: " << cuda.summary() << "; cpu: " << cpu.summary();
}

// The same with a codec and an outer optimizer: the changes since the last average go through the
// codec (fp16: both devices' changes round alike but for the last bit of a few) and Nesterov's
// outer step, all in host memory, and come back to the device.
TEST(GpuSync, AveragingWithACodecAndAnOuterOptimizerOnCudaEqualsTheCpuRun) {
  REQUIRE_GPU();
  test::TempDir dir;
  const std::string command =
      test::launchPrefix(2) + train("--model mlp --data synthetic:1200 --optimizer sgd --lr 0.1 --batch 8 --steps 8 "
                                    "--strategy average --period 2 --codec fp16 --outer-optimizer nesterov "
                                    "--outer-lr 0.7 --device {device} --save-model " + dir.file("{run}{rank}.pt"));
  auto [cuda, cpu] = runBoth(dir, command, 8);
  if (HasFailure()) return;
  const auto cuda0 = test::loadParameters(dir.file("cuda0.pt")), cuda1 = test::loadParameters(dir.file("cuda1.pt"));
  const auto cpu0 = test::loadParameters(dir.file("cpu0.pt"));
  expectIdenticalReplicas(cuda0, cuda1, "average --codec fp16 --outer-optimizer nesterov on cuda");
  expectClose(cuda0, cpu0, "average --codec fp16 --outer-optimizer nesterov, rank 0");
}

// `--strategy ps` with a CPU shard (cohort launch --ps 1) and 2 workers sharing cuda:0. Sync mode
// with plain SGD is deterministic (tests/ps_test.cpp: it equals allreduce within 1e-5), so the
// trained parameters equal the CPU run's within the tolerances above; the loss is finite and the
// accuracy the CPU run's.
TEST(GpuSync, ParameterServerWorkersOnCudaWithACpuShardMatchTheCpuRun) {
  REQUIRE_GPU();
  test::TempDir dir;
  const std::string command =
      test::launchPrefix(2, 1) + train("--model mlp --data synthetic:1200 --optimizer sgd --lr 0.1 --batch 8 "
                                       "--steps 12 --strategy ps --ps-mode sync --device {device} --save-model " +
                                       dir.file("{run}.pt"));
  auto [cuda, cpu] = runBoth(dir, command, 12);
  if (HasFailure()) return;
  EXPECT_TRUE(std::isfinite(cuda.lastLoss)) << cuda.summary();
  EXPECT_NEAR(cuda.done.value("test_accuracy", -1.0), cpu.done.value("test_accuracy", -1.0), 0.02)
      << "cuda: " << cuda.summary() << "; cpu: " << cpu.summary();
  expectClose(test::loadParameters(dir.file("cuda.pt")), test::loadParameters(dir.file("cpu.pt")), "ps sync, the chief");
}

// The other ps path on a device: async, each worker running its own optimizer and pushing the
// change it made (--push updates: the parameters, not the gradients, leave the device). Async
// arrival orders differ from run to run on any device, so the check is the outcome: a finite loss
// and an accuracy near the CPU run's.
TEST(GpuSync, ParameterServerAsyncUpdatesFromCudaWorkersTrainAsOnTheCpu) {
  REQUIRE_GPU();
  test::TempDir dir;
  const std::string command =
      test::launchPrefix(2, 1) + train("--model mlp --data synthetic:4000 --optimizer sgd --lr 0.05 --batch 32 "
                                       "--steps 150 --strategy ps --ps-mode async --push updates --device {device}");
  auto [cuda, cpu] = runBoth(dir, command, 150);
  if (HasFailure()) return;
  EXPECT_TRUE(std::isfinite(cuda.lastLoss)) << cuda.summary();
  EXPECT_NEAR(cuda.done.value("test_accuracy", -1.0), cpu.done.value("test_accuracy", -1.0), 0.05)
      << "cuda: " << cuda.summary() << "; cpu: " << cpu.summary();
}

// `--strategy gossip` with 2 peers sharing cuda:0 finishes, and reaches about the CPU run's
// accuracy (gossip is asynchronous: which updates arrive before which step differs between runs).
TEST(GpuSync, GossipPeersOnCudaTrainAsOnTheCpu) {
  REQUIRE_GPU();
  test::TempDir dir;
  const std::string command =
      test::launchPrefix(2) + train("--model mlp --data synthetic:4000 --optimizer sgd --lr 0.05 --batch 32 "
                                    "--steps 150 --strategy gossip --device {device} --save-model " +
                                    dir.file("{run}{rank}.pt"));
  auto [cuda, cpu] = runBoth(dir, command, 150);
  if (HasFailure()) return;
  EXPECT_TRUE(std::isfinite(cuda.lastLoss)) << cuda.summary();
  EXPECT_GT(cuda.done.value("messages_applied", int64_t(0)), 0) << "no peer's update reached the chief: " << cuda.summary();
  EXPECT_NEAR(cuda.done.value("test_accuracy", -1.0), cpu.done.value("test_accuracy", -1.0), 0.05)
      << "cuda: " << cuda.summary() << "; cpu: " << cpu.summary();
  // Every update reaches every replica by the end (finish() sends what is left and waits for the
  // others' DONE; the final synchronize() adds what arrived), so the replicas differ only by the
  // order of float additions: ~1e-8 on the CPU, checked alike for both runs.
  for (const std::string run : {"cuda", "cpu"}) {
    const auto rank0 = test::loadParameters(dir.file(run + "0.pt")), rank1 = test::loadParameters(dir.file(run + "1.pt"));
    EXPECT_LT(test::maxDifference(rank0, rank1), 1e-4)
        << "the " << run << " peers ended apart: " << worstElement(rank0, rank1);
  }
}

// Gossip with a bfloat16 model on cuda:0 (its pinned float32 host mirror): the replica sends its
// own change exactly and none of the rounding of what it received (tests/gossip_handle.h, which
// tests/gossip_test.cpp runs on the CPU).
TEST(GpuSync, GossipOfABfloat16ModelOnCudaSendsOnlyItsOwnChange) {
  REQUIRE_GPU();
  test::expectBfloat16ReplicaSendsOnlyItsOwnChange(torch::Device(torch::kCUDA, 0));
}

// ParameterAveraging of a bfloat16 model on cuda:0 (its pinned host mirror in bfloat16), 2 ranks
// as threads sharing the GPU (no hook of the handle runs inside backward, so they may), period 1
// with plain SGD: equal to one process on both ranks' batches on the same GPU within bfloat16's
// rounding (the CPU test saw 5.9e-3 and asserts 1.2e-2), and the ranks end bit-identical.
TEST(GpuSync, AveragingABfloat16ModelOnCudaEqualsOneProcessThere) {
  REQUIRE_GPU();
  const torch::Device gpu(torch::kCUDA, 0);
  const auto on = torch::TensorOptions().device(gpu).dtype(torch::kBFloat16);
  const auto make = [&] {
    torch::manual_seed(6);
    torch::nn::Sequential net(torch::nn::Linear(12, 32), torch::nn::ReLU(), torch::nn::Linear(32, 5));
    net->to(gpu, torch::kBFloat16);
    return net;
  };
  torch::manual_seed(7);
  const auto x = torch::randn({6, 16, 12}).to(on);
  const auto y = torch::randint(0, 5, {6, 16}).to(gpu);
  const auto lossOf = [](torch::nn::Sequential& net, const torch::Tensor& in, const torch::Tensor& target) {
    return torch::nn::functional::cross_entropy(net->forward(in), target);
  };
  auto alone = make();
  torch::optim::SGD aloneOpt(alone->parameters(), 0.1);
  for (int64_t s = 0; s < x.size(0); ++s) {
    aloneOpt.zero_grad();
    lossOf(alone, x[s], y[s]).backward();
    aloneOpt.step();
  }
  std::vector<torch::nn::Sequential> nets{make(), make()};  // made here: the ranks share torch's generator
  std::vector<std::vector<torch::Tensor>> got(2);
  test::onRanks(2, [&](std::shared_ptr<Communicator> comm) {
    const int r = comm->rank();
    auto& net = nets[size_t(r)];
    torch::optim::SGD opt(net->parameters(), 0.1);
    ParameterAveraging averaging(Job::fromCommunicator(comm), *net, &opt, {.period = 1});
    for (int64_t s = 0; s < x.size(0); ++s) {
      opt.zero_grad();
      lossOf(net, x[s].narrow(0, 8 * r, 8), y[s].narrow(0, 8 * r, 8)).backward();
      opt.step();
      averaging.step();
    }
    for (const auto& p : net->parameters()) {
      EXPECT_EQ(p.device(), gpu);
      EXPECT_EQ(p.scalar_type(), torch::kBFloat16);
      got[size_t(r)].push_back(p.detach().to(torch::kCPU, torch::kFloat64));
    }
  });
  std::vector<torch::Tensor> expected, start;
  for (const auto& p : alone->parameters()) expected.push_back(p.detach().to(torch::kCPU, torch::kFloat64));
  for (const auto& p : make()->parameters()) start.push_back(p.detach().to(torch::kCPU, torch::kFloat64));
  EXPECT_EQ(test::maxDifference(got[0], got[1]), 0.0) << "the ranks differ after the last average";
  EXPECT_LT(test::maxDifference(got[0], expected), 1.2e-2) << worstElement(got[0], expected);
  EXPECT_GT(test::maxDifference(got[0], start), 1e-2) << "training did not move the parameters";
  // A model of two dtypes on the GPU: its host mirror holds one, so it is refused by name.
  test::onRanks(1, [&](std::shared_ptr<Communicator> comm) {
    auto mixed = make();
    mixed->ptr(2)->to(torch::kFloat32);
    try {
      ParameterAveraging averaging(Job::fromCommunicator(comm), *mixed, nullptr, {});
      FAIL() << "a bfloat16 and float32 model on cuda:0 was accepted";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("convert it to one"), std::string::npos) << e.what();
    }
  });
}

// The ps client with a bfloat16 model on cuda:0 and two in-process CPU shards: the gradients leave
// the device into a pinned float32 buffer (converted on the way), the shards' float32 parameters
// come back rounded to bfloat16. Steps below half a bfloat16 unit of most weights accumulate on
// the shards: the model follows the float32 model on the same GPU from the same start, rounded
// (the CPU test, tests/sparse_test.cpp, saw 26 of 163 weights move, 0 apart).
TEST(GpuSync, ParameterServerKeepsFloat32MasterWeightsOfABfloat16ModelOnCuda) {
  REQUIRE_GPU();
  const torch::Device gpu(torch::kCUDA, 0);
  const auto make = [&](torch::Dtype dtype) {
    torch::manual_seed(12);
    torch::nn::Sequential net(torch::nn::Linear(6, 16), torch::nn::ReLU(), torch::nn::Linear(16, 3));
    net->to(torch::kBFloat16);  // the same bfloat16 start for both runs
    net->to(gpu, dtype);
    return net;
  };
  torch::manual_seed(13);
  const auto x = torch::randn({8, 32, 6});
  const auto y = torch::randint(0, 3, {8, 32});
  const auto train = [&](torch::Dtype dtype) {
    auto net = make(dtype);
    std::vector<std::unique_ptr<ps::ShardServer>> servers;
    std::vector<std::string> hosts;
    for (int i = 0; i < 2; ++i) {
      servers.push_back(
          std::make_unique<ps::ShardServer>(ps::ServerOptions{.shard = {.log = [](const std::string&) {}}}));
      hosts.push_back("127.0.0.1:" + std::to_string(servers.back()->port()));
    }
    ParameterServerClient client(Job::single(), *net, nullptr,
                                 {.mode = PsMode::kSync, .optimizer = PsOptimizer::kSgd, .lr = 2e-4, .hosts = hosts});
    for (int s = 0; s < 64; ++s) {
      for (auto& p : net->parameters()) p.mutable_grad().reset();
      torch::nn::functional::cross_entropy(net->forward(x[s % 8].to(gpu, dtype)), y[s % 8].to(gpu)).backward();
      client.step(32);
    }
    client.finish();
    std::vector<torch::Tensor> out;  // as bfloat16 values, on the CPU in float64
    for (const auto& p : net->parameters()) {
      EXPECT_EQ(p.device(), gpu);
      EXPECT_EQ(p.scalar_type(), dtype);
      out.push_back(p.detach().to(torch::kBFloat16).to(torch::kCPU, torch::kFloat64));
    }
    return out;
  };
  std::vector<torch::Tensor> initial;
  for (const auto& p : make(torch::kBFloat16)->parameters())
    initial.push_back(p.detach().to(torch::kCPU, torch::kFloat64));
  const auto float32 = train(torch::kFloat32);
  const auto bf16 = train(torch::kBFloat16);
  int64_t moved = 0, apart = 0;
  for (size_t i = 0; i < bf16.size(); ++i) {
    moved += bf16[i].ne(initial[i]).sum().item<int64_t>();
    apart += bf16[i].ne(float32[i]).sum().item<int64_t>();
  }
  EXPECT_GE(moved, 10) << "the shards' float32 updates did not reach the model on cuda:0";
  EXPECT_LE(apart, moved / 10) << moved << " moved; " << worstElement(bf16, float32);
  EXPECT_LE(test::maxDifference(bf16, float32), 8e-3) << worstElement(bf16, float32);
}

}  // namespace
}  // namespace cohort::gpu_sync_test
