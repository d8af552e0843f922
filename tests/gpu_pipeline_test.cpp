// The pipeline, tensor and in-process replica schemes on one CUDA GPU (ctest label gpu; run by
// scripts/gpu-check.sh, never by CI). Without a GPU every test fails at once, naming what is
// missing. Every comparison prints the largest difference and the devices involved.
#include <cohort/device.h>
#include <cohort/error.h>
#include <cohort/models.h>
#include <cohort/replicas.h>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <sstream>
#include <string>
#include <vector>

#include "model_util.h"
#include "schemes/pipeline_split.h"
#include "gpu_util.h"
#include "test_util.h"

namespace cohort::gpu_pipeline_test {
namespace {

using test::fractionDifferent;
using test::maxDifference;

// Plain SGD, a few steps, one thread per process: as tests/pipeline_test.cpp's CPU equivalence.
const std::string kCommon =
    " train --model mlp --data synthetic:1200 --optimizer sgd --lr 0.1 --steps 4 --threads 1 --progress off"
    " --timeout 60";

std::vector<torch::Tensor> onCpu(const std::vector<torch::Tensor>& tensors) {
  std::vector<torch::Tensor> out;
  for (const auto& t : tensors) out.push_back(t.detach().to(torch::kCPU).clone());
  return out;
}

// The whole mlp's parameters from the files each stage saved (stage s in files[s]), cut as `cut`
// says, on the CPU whatever device wrote them.
std::vector<torch::Tensor> loadStages(const std::vector<std::string>& files, const std::vector<int>& cut) {
  auto whole = makeModel("mlp", {});
  std::vector<torch::Tensor> out;
  int first = 0;
  for (size_t s = 0; s < files.size(); ++s) {
    auto stage = sliceModel(whole, first, cut[s]);
    torch::load(stage, files[s], torch::Device(torch::kCPU));
    for (auto& p : stage->parameters()) out.push_back(p.detach().to(torch::kCPU).clone());
    first += cut[s];
  }
  return out;
}

std::vector<torch::Tensor> loadWhole(const std::string& file) {
  auto net = makeModel("mlp", {});
  torch::load(net, file, torch::Device(torch::kCPU));
  return onCpu(net->parameters());
}

std::vector<int> cutOf(const nlohmann::json& done) {
  std::vector<int> cut;
  for (const auto& c : done["cut"]) cut.push_back(c.get<int>());
  return cut;
}

// Every step's loss in a metrics file, in order.
std::vector<double> stepLosses(const std::string& metrics) {
  std::vector<double> out;
  for (const auto& line : test::lines(test::readFile(metrics))) {
    auto j = nlohmann::json::parse(line);
    if (j["event"] == "step") out.push_back(j["loss"].get<double>());
  }
  return out;
}

std::string join(const std::vector<double>& values) {
  std::ostringstream out;
  out.precision(9);
  for (size_t i = 0; i < values.size(); ++i) out << (i ? ", " : "") << values[i];
  return out.str();
}

// "max difference 3e-7 (12 of 50890 elements over 1e-5)": what a failed comparison prints.
std::string describe(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b, double tolerance) {
  double elements = 0;
  for (const auto& t : a) elements += double(t.numel());
  std::ostringstream out;
  out << "max difference " << maxDifference(a, b) << " (" << fractionDifferent(a, b, tolerance) * elements << " of "
      << elements << " elements over " << tolerance << ")";
  return out.str();
}

std::vector<torch::Tensor> trainOneProcessOnCuda(const test::TempDir& dir, int batch, const std::string& name) {
  auto r = test::runCommand(test::cohortBinary() + kCommon + " --device cuda:0 --batch " + std::to_string(batch) +
                                " --save-model " + dir.file(name + ".pt") + " --metrics " + dir.file(name + ".jsonl"),
                            120);
  EXPECT_EQ(r.exitCode, 0) << r.output;
  return loadWhole(dir.file(name + ".pt"));
}

// Two stages sharing cuda:0 (separate processes; activations and gradients through pinned host
// memory) equal one process on cuda:0, for both schedules. Tolerance: the CPU test's 1e-5 for
// almost every element. Both runs use the same GPU kernels; what differs is the micro-batch split,
// which changes the order of the batch reduction in the weight gradients (cuBLAS may also pick
// another algorithm for another batch size), a few float32 roundings (~1e-7 relative) per step on
// parameters of order 0.1 over 4 steps, far below 1e-5; an element at a ReLU's kink may flip, so
// (as DataParallel's GPU test) up to 1% may pass 1e-5 and none 1e-3. The losses of every step,
// which the last stage computes and sends to the chief, agree with one process's within 1e-5.
TEST(GpuPipeline, TwoStagesOnOneGpuEqualOneProcessOnIt) {
  REQUIRE_GPU();
  test::TempDir dir;
  const auto single = trainOneProcessOnCuda(dir, 8, "single");
  const auto singleLosses = stepLosses(dir.file("single.jsonl"));
  ASSERT_EQ(singleLosses.size(), 4u) << join(singleLosses);
  for (const auto& [schedule, micro] : {std::pair{"gpipe", 2}, std::pair{"1f1b", 4}}) {
    SCOPED_TRACE(std::string(schedule) + " with " + std::to_string(micro) + " micro-batches, both stages on cuda:0");
    const std::string metrics = dir.file(std::string(schedule) + ".jsonl");
    auto r = test::runCommand(test::launchPrefix(2) + test::cohortBinary() + kCommon +
                                  " --device cuda --batch 8 --strategy pipeline --stages 2 --micro-batches " +
                                  std::to_string(micro) + " --schedule " + schedule + " --metrics " + metrics +
                                  " --save-model " + dir.file("stage{rank}.pt"),
                              120);
    ASSERT_EQ(r.exitCode, 0) << r.output;
    const auto done = test::lastEvent(metrics, "done");
    EXPECT_EQ(done["steps"], 4) << done.dump();
    EXPECT_EQ(done["micro_batches"], micro) << done.dump();
    const auto cut = cutOf(done);
    ASSERT_EQ(cut.size(), 2u) << done.dump();
    const auto stages = loadStages({dir.file("stage0.pt"), dir.file("stage1.pt")}, cut);
    EXPECT_LT(maxDifference(single, stages), 1e-3) << describe(single, stages, 1e-5) << "\n" << r.output;
    EXPECT_LT(fractionDifferent(single, stages, 1e-5), 0.01) << describe(single, stages, 1e-5);
    const auto losses = stepLosses(metrics);
    ASSERT_EQ(losses.size(), singleLosses.size()) << "pipeline: " << join(losses) << "; one process: "
                                                  << join(singleLosses);
    for (size_t i = 0; i < losses.size(); ++i) {
      EXPECT_NEAR(losses[i], singleLosses[i], 1e-5) << "step " << i + 1 << ": pipeline " << join(losses)
                                                    << "; one process " << join(singleLosses);
    }
  }
}

// Two stages times two replicas, four processes on cuda:0: the stages' replicas average their
// gradients through Gloo over CUDA tensors, and equal one process with the doubled batch (the
// tolerance as above), the two replicas' copies of each stage bit-identical.
TEST(GpuPipeline, TwoStagesTimesTwoReplicasOnOneGpuEqualOneProcessWithTheDoubledBatch) {
  REQUIRE_GPU();
  test::TempDir dir;
  const auto single = trainOneProcessOnCuda(dir, 16, "single");
  auto r = test::runCommand(test::launchPrefix(4) + test::cohortBinary() + kCommon +
                                " --device cuda --batch 8 --strategy pipeline --stages 2 --replicas 2 "
                                "--micro-batches 2 --partition 3,3 --metrics " + dir.file("m.jsonl") +
                                " --save-model " + dir.file("rank{rank}.pt"),
                            120);
  ASSERT_EQ(r.exitCode, 0) << r.output;
  const std::vector<int> cut{3, 3};
  const auto replica0 = loadStages({dir.file("rank0.pt"), dir.file("rank1.pt")}, cut);
  const auto replica1 = loadStages({dir.file("rank2.pt"), dir.file("rank3.pt")}, cut);
  EXPECT_LT(maxDifference(single, replica0), 1e-3) << describe(single, replica0, 1e-5);
  EXPECT_LT(fractionDifferent(single, replica0, 1e-5), 0.01) << describe(single, replica0, 1e-5);
  EXPECT_EQ(maxDifference(replica0, replica1), 0.0) << "the replicas of a stage differ: "
                                                    << describe(replica0, replica1, 0);
  EXPECT_EQ(test::lastEvent(dir.file("m.jsonl"), "done")["steps"], 4);
}

// Two tensor-parallel ways sharing cuda:0 (separate processes; the ways' sums through Gloo over
// CUDA tensors): every step's loss equals one process's on cuda:0 within 1e-5 (the whole model's
// output, computed from the ways' parts: equal models give equal losses up to the order of the
// split sums), and the run evaluates (the ways' forward in evaluation too).
TEST(GpuPipeline, TensorWaysOnOneGpuTrainAsOneProcessOnIt) {
  REQUIRE_GPU();
  test::TempDir dir;
  trainOneProcessOnCuda(dir, 8, "single");
  const auto singleLosses = stepLosses(dir.file("single.jsonl"));
  auto r = test::runCommand(test::launchPrefix(2) + test::cohortBinary() + kCommon +
                                " --device cuda --batch 8 --strategy tensor --ways 2 --metrics " + dir.file("m.jsonl"),
                            120);
  ASSERT_EQ(r.exitCode, 0) << r.output;
  const auto losses = stepLosses(dir.file("m.jsonl"));
  ASSERT_EQ(losses.size(), singleLosses.size()) << "tensor: " << join(losses) << "; one process: "
                                                << join(singleLosses);
  for (size_t i = 0; i < losses.size(); ++i) {
    EXPECT_NEAR(losses[i], singleLosses[i], 1e-5) << "step " << i + 1 << ": tensor " << join(losses)
                                                  << "; one process " << join(singleLosses);
  }
  const auto done = test::lastEvent(dir.file("m.jsonl"), "done");
  const auto single = test::lastEvent(dir.file("single.jsonl"), "done");
  EXPECT_NEAR(done["test_accuracy"].get<double>(), single["test_accuracy"].get<double>(), 0.01)
      << "tensor " << done.dump() << "\none process " << single.dump();
}

// ---- replicas as threads of one process, through the library ----

torch::nn::Sequential smallNet(uint64_t seed) {
  torch::manual_seed(seed);
  return torch::nn::Sequential(torch::nn::Linear(12, 32), torch::nn::ReLU(), torch::nn::Linear(32, 5));
}

const ShardLoss kLoss = [](int, torch::nn::Module& m, const torch::Tensor& x, const torch::Tensor& y) {
  return torch::nn::functional::cross_entropy(m.as<torch::nn::SequentialImpl>()->forward(x), y);
};

struct Batches {
  std::vector<torch::Tensor> x, y;
};

Batches batches(int steps, int64_t n) {
  torch::manual_seed(11);
  Batches d;
  for (int i = 0; i < steps; ++i) {
    d.x.push_back(torch::randn({n, 12}));
    d.y.push_back(torch::randint(0, 5, {n}));
  }
  return d;
}

// R replicas of the small net, its model on `device`, trained on the batches (on the CPU: the
// handle copies each shard to its replica's device). Returns every replica's parameters, on the CPU.
std::vector<std::vector<torch::Tensor>> trainReplicas(bool central, int R, const torch::Device& device,
                                                      const Batches& d, std::vector<std::string>* devices = nullptr) {
  auto net = smallNet(5);
  net->to(device);
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  std::unique_ptr<ReplicaGroup> group;
  if (central) {
    group = std::make_unique<CentralStorage>(net.ptr(), opt, ReplicaOptions{.replicas = R, .bucketMb = 0.0005});
  } else {
    group = std::make_unique<Mirrored>(net.ptr(), opt, ReplicaOptions{.replicas = R, .bucketMb = 0.0005});
  }
  for (size_t i = 0; i < d.x.size(); ++i) group->step(d.x[i], d.y[i], kLoss);
  std::vector<std::vector<torch::Tensor>> out;
  for (int r = 0; r < R; ++r) {
    out.push_back(onCpu(group->replica(r).parameters()));
    if (devices) devices->push_back(group->replica(r).parameters()[0].device().str());
  }
  return out;
}

// Mirrored with 2 replicas sharing cuda:0 equals the same on the CPU (the same initial parameters,
// batches and momentum SGD, 6 steps; shards of 7 and 6 examples). Tolerance 1e-5: the only
// difference is the kernels' summation order (GPU and CPU GEMMs), a float32 rounding (~1e-7
// relative) per operation on values of order 1 over 6 steps; the copies are bit-identical.
TEST(GpuReplicas, MirroredOnOneGpuEqualsTheCpuRunAndItsReplicasAreIdentical) {
  REQUIRE_GPU();
  const Batches d = batches(6, 13);
  const auto cpu = trainReplicas(false, 2, torch::Device(torch::kCPU), d);
  std::vector<std::string> devices;
  const auto gpu = trainReplicas(false, 2, torch::Device(torch::kCUDA, 0), d, &devices);
  EXPECT_EQ(devices, (std::vector<std::string>{"cuda:0", "cuda:0"}));
  EXPECT_LT(maxDifference(cpu[0], gpu[0]), 1e-5) << "cpu against cuda:0: " << describe(cpu[0], gpu[0], 1e-5);
  EXPECT_EQ(maxDifference(gpu[0], gpu[1]), 0.0) << "replicas 0 and 1 on cuda:0 differ: " << describe(gpu[0], gpu[1], 0);
  EXPECT_GT(maxDifference(onCpu(smallNet(5)->parameters()), gpu[0]), 1e-3) << "training did not move the parameters";
}

// CentralStorage with 2 replicas sharing cuda:0 (one parameter set there) equals the CPU run.
TEST(GpuReplicas, CentralStorageOnOneGpuEqualsTheCpuRun) {
  REQUIRE_GPU();
  const Batches d = batches(6, 13);
  const auto cpu = trainReplicas(true, 2, torch::Device(torch::kCPU), d);
  const auto gpu = trainReplicas(true, 2, torch::Device(torch::kCUDA, 0), d);
  EXPECT_LT(maxDifference(cpu[0], gpu[0]), 1e-5) << "cpu against cuda:0: " << describe(cpu[0], gpu[0], 1e-5);
  EXPECT_EQ(maxDifference(gpu[0], gpu[1]), 0.0) << "the replicas do not share the parameters: "
                                                << describe(gpu[0], gpu[1], 0);
}

// cohort train --strategy mirrored and central --replicas 2 --device cuda train on the GPU and equal
// the same run on the CPU (tolerance as DataParallel's GPU test: CPU and GPU kernels differ in
// summation order, and a ReLU at its kink may flip).
TEST(GpuReplicas, MirroredAndCentralTrainOnCudaUnderCohortTrainAsOnTheCpu) {
  REQUIRE_GPU();
  for (const std::string strategy : {"mirrored", "central"}) {
    SCOPED_TRACE("--strategy " + strategy);
    test::TempDir dir;
    const std::string common = kCommon + " --batch 16 --strategy " + strategy + " --replicas 2";
    auto gpu = test::runCommand(test::cohortBinary() + common + " --device cuda --save-model " + dir.file("gpu.pt") +
                                    " --metrics " + dir.file("gpu.jsonl"),
                                120);
    ASSERT_EQ(gpu.exitCode, 0) << gpu.output;
    auto cpu = test::runCommand(test::cohortBinary() + common + " --device cpu --save-model " + dir.file("cpu.pt"), 120);
    ASSERT_EQ(cpu.exitCode, 0) << cpu.output;
    const auto onGpu = loadWhole(dir.file("gpu.pt"));
    const auto onCpuRun = loadWhole(dir.file("cpu.pt"));
    EXPECT_LT(maxDifference(onCpuRun, onGpu), 1e-3) << describe(onCpuRun, onGpu, 1e-5);
    EXPECT_LT(fractionDifferent(onCpuRun, onGpu, 1e-5), 0.01) << describe(onCpuRun, onGpu, 1e-5);
    const auto done = test::lastEvent(dir.file("gpu.jsonl"), "done");
    EXPECT_EQ(done["steps"], 4) << done.dump();
    EXPECT_TRUE(done.contains("cuda_peak_bytes")) << "no cuda_peak_bytes: did it train on the GPU? " << done.dump();
  }
}

// Mirrored with 2 replicas sharing cuda:0 on a bfloat16 model: the buckets sum in bfloat16 on the
// device, the replicas stay bit-identical and end within bfloat16's rounding of one process on
// the same GPU (the CPU test, tests/replicas_test.cpp, saw 4.9e-4 and asserts 4e-3).
TEST(GpuReplicas, MirroredOnABfloat16ModelOnOneGpuEqualsOneProcessThere) {
  REQUIRE_GPU();
  const torch::Device gpu(torch::kCUDA, 0);
  const Batches d = batches(4, 12);
  auto alone = smallNet(5);
  alone->to(gpu, torch::kBFloat16);
  torch::optim::SGD aloneOpt(alone->parameters(), 0.1);
  for (size_t i = 0; i < d.x.size(); ++i) {
    aloneOpt.zero_grad();
    kLoss(0, *alone, d.x[i].to(gpu, torch::kBFloat16), d.y[i].to(gpu)).backward();
    aloneOpt.step();
  }
  auto net = smallNet(5);
  net->to(gpu, torch::kBFloat16);
  torch::optim::SGD opt(net->parameters(), 0.1);
  Mirrored mirrored(net.ptr(), opt, {.replicas = 2, .bucketMb = 0.0005});
  for (size_t i = 0; i < d.x.size(); ++i) mirrored.step(d.x[i].to(torch::kBFloat16), d.y[i], kLoss);
  for (const auto& p : net->parameters()) {
    EXPECT_EQ(p.device(), gpu);
    EXPECT_EQ(p.scalar_type(), torch::kBFloat16);
  }
  const auto asDouble = [](const std::vector<torch::Tensor>& ps) {
    std::vector<torch::Tensor> out;
    for (const auto& p : ps) out.push_back(p.detach().to(torch::kCPU, torch::kFloat64));
    return out;
  };
  const auto got = asDouble(net->parameters());
  EXPECT_LT(maxDifference(got, asDouble(alone->parameters())), 4e-3);
  EXPECT_EQ(maxDifference(got, asDouble(mirrored.replica(1).parameters())), 0.0) << "the replicas differ";
  EXPECT_GT(maxDifference(asDouble(smallNet(5)->parameters()), got), 1e-3) << "training did not move the parameters";
}

// Hogwild stays a CPU scheme, in the library too: one line naming the fix.
TEST(GpuReplicas, HogwildRefusesAModelOnTheGpuInOneLine) {
  REQUIRE_GPU();
  auto net = smallNet(1);
  net->to(torch::Device(torch::kCUDA, 0));
  torch::optim::SGD opt(net->parameters(), 0.1);
  try {
    Hogwild hogwild(net.ptr(), opt, {.replicas = 2});
    FAIL() << "Hogwild accepted a model on cuda:0";
  } catch (const InvalidArgument& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("a CPU scheme"), std::string::npos) << what;
    EXPECT_EQ(what.find('\n'), std::string::npos) << what;
  }
}

}  // namespace
}  // namespace cohort::gpu_pipeline_test
