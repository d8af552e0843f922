// What needs a CUDA GPU (ctest label gpu; run by scripts/gpu-check.sh, never by CI). Without a GPU
// every test here fails at once, naming what is missing: a test that cannot run fails loudly.
#include <cohort/data_parallel.h>
#include <cohort/device.h>
#include <cohort/error.h>
#include <cohort/job.h>
#include <cohort/optim.h>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <string>
#include <vector>

#include "model_util.h"
#include "gpu_util.h"
#include "test_util.h"

namespace cohort::gpu_test {
namespace {

std::string train(const std::string& options) {
  return test::cohortBinary() + " train --progress off --timeout 60 " + options;
}

double finalAccuracy(const std::string& metrics) {
  return test::lastEvent(metrics, "done")["test_accuracy"].get<double>();
}

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

// --autocast bf16 on cuda:0 (the cnn's convolutions and linear layers in bfloat16 on the GPU's
// tensor cores): one process reaches the float32 CPU run's accuracy within 3 points, and so does
// allreduce with 2 ranks sharing the GPU (its buckets stay float32); and --autocast fp16 with its
// loss scaler, in one process. A suite of its own: scripts/gpu-check.sh runs every suite in a
// process of its own, within its own timeout, and these five runs would crowd Gpu's.
TEST(GpuAutocast, TheCnnOnCudaLearnsAsInFloat32) {
  REQUIRE_GPU();
  test::TempDir dir;
  // --batch is per worker: the two ranks take 32 each, so that every run steps on 64 examples.
  const std::string common = "--model cnn --data fashion-mnist --steps 300 --seed 3 ";
  auto cpu = test::runCommand(train(common + "--batch 64 --device cpu --metrics " + dir.file("cpu.jsonl")));
  ASSERT_EQ(cpu.exitCode, 0) << cpu.output;
  auto gpu =
      test::runCommand(train(common + "--batch 64 --device cuda:0 --autocast bf16 --metrics " + dir.file("gpu.jsonl")));
  ASSERT_EQ(gpu.exitCode, 0) << gpu.output;
  auto two = test::runCommand(test::launchPrefix(2) + train(common +
                                                            "--batch 32 --device cuda --autocast bf16 --strategy "
                                                            "allreduce --metrics " +
                                                            dir.file("two.jsonl")));
  ASSERT_EQ(two.exitCode, 0) << two.output;
  const double onCpu = finalAccuracy(dir.file("cpu.jsonl"));
  EXPECT_EQ(test::lastEvent(dir.file("gpu.jsonl"), "done").value("autocast", ""), "bf16");
  EXPECT_EQ(test::lastEvent(dir.file("two.jsonl"), "done").value("autocast", ""), "bf16");
  EXPECT_NEAR(finalAccuracy(dir.file("gpu.jsonl")), onCpu, 0.03);
  EXPECT_NEAR(finalAccuracy(dir.file("two.jsonl")), onCpu, 0.03);
  auto fp16 = test::runCommand(
      train(common + "--batch 64 --device cuda:0 --autocast fp16 --metrics " + dir.file("fp16.jsonl")));
  ASSERT_EQ(fp16.exitCode, 0) << fp16.output;
  const auto done = test::lastEvent(dir.file("fp16.jsonl"), "done");
  EXPECT_EQ(done.value("autocast", ""), "fp16");
  EXPECT_LT(done.value("skipped_steps", int64_t(-1)), 10) << "the scale kept overflowing";
  EXPECT_GE(done.value("skipped_steps", int64_t(-1)), 0) << "no loss scaler reported";
  EXPECT_NEAR(finalAccuracy(dir.file("fp16.jsonl")), onCpu, 0.03);
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

// Two ranks sharing cuda:0 (Gloo over CUDA tensors), as processes: ranks as threads of one process
// cannot share a GPU, since autograd runs every backward on that device in one thread, and one
// rank's end-of-backward wait would block the other's hooks. They equal one process with twice the
// batch (as tests/dataparallel_test.cpp's CPU equivalence: almost every element within 1e-5, none
// far off; a ReLU at zero may flip), and their replicas stay bit-identical.
TEST(Gpu, DataParallelOnCudaEqualsOneProcessWithTheCombinedBatch) {
  REQUIRE_GPU();
  test::TempDir dir;
  const std::string common = "--model mlp --data synthetic:1200 --optimizer sgd --lr 0.1 --steps 6 --threads 1 ";
  auto single = test::runCommand(train(common + "--device cuda:0 --batch 16 --save-model " + dir.file("single.pt")));
  ASSERT_EQ(single.exitCode, 0) << single.output;
  auto multi = test::runCommand(test::launchPrefix(2) + train(common + "--device cuda --batch 8 --strategy allreduce "
                                                              "--save-model " + dir.file("rank{rank}.pt")));
  ASSERT_EQ(multi.exitCode, 0) << multi.output;
  const auto one = test::loadParameters(dir.file("single.pt"));
  const auto rank0 = test::loadParameters(dir.file("rank0.pt"));
  const auto rank1 = test::loadParameters(dir.file("rank1.pt"));
  for (size_t i = 0; i < rank0.size(); ++i) EXPECT_TRUE(torch::equal(rank0[i], rank1[i])) << "replicas differ: " << i;
  EXPECT_LT(test::maxDifference(one, rank0), 1e-3);
  EXPECT_LT(test::fractionDifferent(one, rank0, 1e-5), 0.01) << "max " << test::maxDifference(one, rank0);
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

// --profile on the GPU: the window's kernels are in the trace, and the compute stream is a lane of
// its own, busy for part of the window and for no longer than it lasted, with its top kernel named.
TEST(GpuProfile, TheWindowSaysWhereTheTimeWentPerCudaStream) {
  REQUIRE_GPU();
  test::TempDir dir;
  auto r =
      test::runCommand(train("--strategy allreduce --model cnn --data synthetic:4000 --steps 30 --device cuda "
                             "--profile " +
                             dir.file("t.json") + " --profile-steps 21:25 --metrics " + dir.file("m.jsonl")));
  ASSERT_EQ(r.exitCode, 0) << r.output;
  int streams = 0;
  for (const auto& e : test::events(dir.file("m.jsonl"), "profile")) {
    if (e["lane"].get<std::string>().rfind("cuda:0 stream ", 0) != 0) continue;
    ++streams;
    EXPECT_GT(e["busy_s"].get<double>(), 0.0) << e.dump();
    EXPECT_LE(e["busy_s"].get<double>(), e["window_s"].get<double>()) << e.dump();
    EXPECT_FALSE(e["top"].get<std::string>().empty()) << e.dump();
  }
  EXPECT_GE(streams, 1) << "no CUDA stream in the profile: " << r.output;
  int kernels = 0;
  for (const auto& e : nlohmann::json::parse(test::readFile(dir.file("t.json"))).at("traceEvents")) {
    if (e.contains("cat") && e["cat"] == "kernel") ++kernels;
  }
  EXPECT_GT(kernels, 0) << "no kernel in the trace";
}

// ForeachSGD on CUDA (multi-tensor kernels) against torch::optim::SGD (a kernel per operation and
// parameter) from the same start: the same momentum SGD; the kernels may contract the
// multiply-add differently, so within a rounding, not bit for bit.
TEST(GpuOptim, ForeachSGDFollowsTorchOptimSGDOnCuda) {
  REQUIRE_GPU();
  torch::manual_seed(5);
  torch::nn::Sequential a(torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 8, 3)), torch::nn::ReLU(), torch::nn::Flatten(),
                          torch::nn::Linear(8 * 26 * 26, 10));
  auto b = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(a->clone());
  a->to(torch::kCUDA);
  b->to(torch::kCUDA);
  const auto o = torch::optim::SGDOptions(0.05).momentum(0.9);
  torch::optim::SGD reference(a->parameters(), o);
  ForeachSGD foreach (b->parameters(), o);
  const auto x = torch::randn({16, 1, 28, 28}, torch::kCUDA);
  const auto y = torch::randint(0, 10, {16}, torch::TensorOptions().dtype(torch::kInt64).device(torch::kCUDA));
  for (int s = 0; s < 5; ++s) {
    reference.zero_grad();
    foreach
      .zero_grad();
    torch::nn::functional::cross_entropy(a->forward(x), y).backward();
    torch::nn::functional::cross_entropy(b->forward(x), y).backward();
    reference.step();
    foreach
      .step();
  }
  const auto pa = a->parameters();
  const auto pb = b->parameters();
  for (size_t i = 0; i < pa.size(); ++i) {
    EXPECT_TRUE(pb[i].is_cuda());
    EXPECT_LT((pa[i] - pb[i]).abs().max().item<float>(), 1e-5) << "parameter " << i;
  }
}

// A model trained on the GPU scores the same in `cohort ensemble` on the GPU as on the CPU (the
// kernels sum in other orders: an argmax at a near-tie may flip), and the evaluator task scores
// the chief's checkpoints on the workers' device.
TEST(GpuAfterTraining, EnsembleAndTheEvaluatorScoreOnTheGpu) {
  REQUIRE_GPU();
  test::TempDir dir;
  const std::string ckpt = dir.file("ckpt");
  auto r = test::runCommand(test::cohortBinary() + " launch -n 1 --evaluator -- " +
                                train("--model cnn --data synthetic:2000 --steps 30 --eval-every 15 --device cuda "
                                      "--checkpoint-dir " +
                                      ckpt + " --save-model " + dir.file("m.pt")),
                            180);
  ASSERT_EQ(r.exitCode, 0) << r.output;
  int evals = 0;
  for (const auto& line : test::lines(test::readFile(ckpt + "/evaluator-0.jsonl"))) {
    const auto e = nlohmann::json::parse(line);
    if (e["event"] != "eval") continue;
    ++evals;
    EXPECT_EQ(e["device"], "cuda:0") << e.dump();
  }
  EXPECT_EQ(evals, 2) << r.output;
  double accuracy[2] = {0, 0};
  const char* devices[2] = {"cuda:0", "cpu"};
  for (int k = 0; k < 2; ++k) {
    const std::string metrics = dir.file(std::string("e") + std::to_string(k) + ".jsonl");
    auto e = test::runCommand(test::cohortBinary() + " ensemble " + dir.file("m.pt") + " " + dir.file("m.pt") +
                              " --data synthetic:2000 --device " + devices[k] + " --metrics " + metrics);
    ASSERT_EQ(e.exitCode, 0) << e.output;
    const auto event = test::lastEvent(metrics, "ensemble");
    EXPECT_EQ(event["device"], devices[k]);
    accuracy[k] = event["test_accuracy"].get<double>();
  }
  EXPECT_GT(accuracy[1], 0.3);
  // 333 test examples: 0.01 is 3 predictions. cuDNN's convolutions run in TF32 by default (LibTorch
  // 2.11), so the GPU's logits are not the CPU's to float32 rounding and a near-tie may flip.
  EXPECT_NEAR(accuracy[0], accuracy[1], 0.01);
}

// A codec's warm-up on a GPU: the first steps go uncompressed (codec none over the device's
// buckets), then the codec takes over. (A suite of its own, as the one above: scripts/gpu-check.sh
// runs each suite in a process of its own, under its own timeout.)
TEST(GpuCodecWarmUp, TheFirstStepsGoUncompressedOnCuda) {
  REQUIRE_GPU();
  test::TempDir dir;
  auto r = test::runCommand(test::launchPrefix(2) + train("--strategy allreduce --model mlp --data synthetic:2000 "
                                                          "--steps 8 --codec topk:0.1 --codec-warmup-steps 3 "
                                                          "--device cuda --metrics " +
                                                          dir.path() + "/m.jsonl"));
  ASSERT_EQ(r.exitCode, 0) << r.output;
  EXPECT_EQ(test::lastEvent(dir.path() + "/m.jsonl", "done")["steps"].get<int64_t>(), 8) << r.output;
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
  // Every codec runs on a CUDA model (tests/gpu_codec_test.cpp): the handle takes one.
  torch::nn::Sequential net(torch::nn::Linear(4, 3));
  net->to(torch::Device(torch::kCUDA, 0));
  EXPECT_NO_THROW(DataParallel(Job::single(), *net, {.codec = "fp16"}));
}

}  // namespace
}  // namespace cohort::gpu_test
