// The pipeline handle used directly (include/cohort/pipeline.h), ranks as threads: two stages,
// under either schedule and with a layer split between them, train as one process does on the
// whole batch, and a job that does not fit the stages is refused.
#include <cohort/autocast.h>
#include <cohort/error.h>
#include <cohort/job.h>
#include <cohort/pipeline.h>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <optional>

#include "rank_threads.h"

namespace cohort::pipeline_handle_test {
namespace {

constexpr int kSteps = 3;

torch::nn::Sequential makeNet() {
  torch::manual_seed(3);
  return torch::nn::Sequential(torch::nn::Linear(4, 8), torch::nn::ReLU(), torch::nn::Linear(8, 3));
}

torch::nn::Sequential copyOf(const torch::nn::Sequential& net) {
  return torch::nn::Sequential(std::dynamic_pointer_cast<torch::nn::SequentialImpl>(net->clone()));
}

torch::Tensor crossEntropy(const torch::Tensor& output, const torch::Tensor& target) {
  return torch::nn::functional::cross_entropy(output, target);
}

struct Run {
  std::vector<double> losses;  // before each step's update
  torch::Tensor outputs;       // after the last step
  int64_t bytesSent = 0;       // by rank 0, over the steps
};

// With `autocast`, the forward pass and the loss run under cohort::Autocast (bfloat16).
Run trainOneProcess(torch::nn::Sequential net, const torch::Tensor& x, const torch::Tensor& y, bool autocast = false) {
  torch::optim::SGD opt(net->parameters(), 0.1);
  Run run;
  for (int i = 0; i < kSteps; ++i) {
    opt.zero_grad();
    torch::Tensor loss;
    {
      std::optional<Autocast> scope;
      if (autocast) scope.emplace(torch::kCPU);
      loss = crossEntropy(net->forward(x), y);
    }
    loss.backward();
    opt.step();
    run.losses.push_back(loss.item<double>());
  }
  run.outputs = net->forward(x).detach();
  return run;
}

// Rank 0's losses and outputs of two stages trained with `options`.
Run trainTwoStages(const torch::nn::Sequential& net, const torch::Tensor& x, const torch::Tensor& y,
                   const PipelineOptions& options) {
  Run run;
  test::onRanks(2, [&](std::shared_ptr<Communicator> comm) {
    Pipeline pipe(Job::fromCommunicator(comm), copyOf(net), x, options);
    EXPECT_EQ(pipe.stage(), comm->rank());
    EXPECT_EQ(pipe.replicas(), 1);
    torch::optim::SGD opt(pipe.module()->parameters(), 0.1);
    std::vector<double> losses;
    int64_t bytesSent = 0;
    for (int i = 0; i < kSteps; ++i) {
      const PipelineStepStats stats = pipe.step(x, y, crossEntropy, opt);
      EXPECT_EQ(stats.microBatches, options.microBatches);
      losses.push_back(stats.loss);
      bytesSent += stats.bytesSent;
    }
    auto outputs = pipe.infer(x);
    pipe.finish();
    if (comm->rank() == 0) {
      run.losses = losses;
      run.outputs = outputs;
      run.bytesSent = bytesSent;
    } else {
      EXPECT_FALSE(outputs.defined());
    }
  });
  return run;
}

void expectTwoStagesEqualOneProcess(const std::string& partition, PipeSchedule schedule, int microBatches,
                                    const torch::nn::Sequential& net = makeNet()) {
  torch::manual_seed(4);
  const auto x = torch::randn({6, 4});
  const auto y = torch::randint(0, 3, {6}, torch::kLong);
  const Run single = trainOneProcess(copyOf(net), x, y);
  const Run piped = trainTwoStages(
      net, x, y, {.stages = 2, .microBatches = microBatches, .schedule = schedule, .partition = partition});
  ASSERT_EQ(piped.losses.size(), single.losses.size());
  for (size_t i = 0; i < single.losses.size(); ++i) EXPECT_NEAR(piped.losses[i], single.losses[i], 1e-5) << i;
  EXPECT_GT(single.losses.front() - single.losses.back(), 1e-3);  // training moved the model
  ASSERT_TRUE(piped.outputs.defined());
  EXPECT_LT((piped.outputs - single.outputs).abs().max().item<double>(), 1e-5);
}

TEST(PipelineHandle, TwoStagesUnderGpipeEqualOneProcess) {
  expectTwoStagesEqualOneProcess("2,1", PipeSchedule::kGpipe, 3);
}

TEST(PipelineHandle, TwoStagesUnderOneFOneBEqualOneProcess) {
  expectTwoStagesEqualOneProcess("1,2", PipeSchedule::kOneFOneB, 2);
}

// A stage whose first layer writes its input in place (ReLU(inplace), common in torchvision's
// models) failed on the received activation, a leaf that requires its gradient ("a leaf Variable
// that requires grad is being used in an in-place operation"); so did the partition's timing of
// any such layer. It gets a copy now.
TEST(PipelineHandle, AStageStartingWithAnInPlaceLayerEqualsOneProcess) {
  torch::manual_seed(3);
  const torch::nn::Sequential net(torch::nn::Linear(4, 8), torch::nn::ReLU(torch::nn::ReLUOptions().inplace(true)),
                                  torch::nn::Linear(8, 3));
  expectTwoStagesEqualOneProcess("1,2", PipeSchedule::kOneFOneB, 2, net);
  expectTwoStagesEqualOneProcess("auto", PipeSchedule::kGpipe, 3, net);
}

TEST(PipelineHandle, ALayerSplitBetweenTwoStagesEqualsOneProcess) {
  expectTwoStagesEqualOneProcess("2+1,1", PipeSchedule::kOneFOneB, 2);
}

// PipelineOptions::autocast: the stages compute under autocast in bfloat16, so the losses leave
// the float32 pipeline's by bfloat16's rounding and stay within it of one process under autocast;
// stage 0's last layer is a Linear, whose bfloat16 output goes back to float32 before it is sent:
// as many bytes as the float32 pipeline sends.
TEST(PipelineHandle, UnderAutocastTheStagesComputeInBfloat16AndSendFloat32) {
  const auto net = makeNet();
  torch::manual_seed(4);
  const auto x = torch::randn({6, 4});
  const auto y = torch::randint(0, 3, {6}, torch::kLong);
  const auto single = trainOneProcess(copyOf(net), x, y, /*autocast=*/true);
  const PipelineOptions options{.stages = 2, .microBatches = 2, .partition = "1,2"};
  const auto float32 = trainTwoStages(net, x, y, options);
  PipelineOptions bf16Options = options;
  bf16Options.autocast = c10::kBFloat16;
  const auto bf16 = trainTwoStages(net, x, y, bf16Options);
  ASSERT_EQ(bf16.losses.size(), single.losses.size());
  double apart = 0;
  for (size_t i = 0; i < single.losses.size(); ++i) {
    EXPECT_NEAR(bf16.losses[i], single.losses[i], 1e-2) << i;
    apart = std::max(apart, std::abs(bf16.losses[i] - float32.losses[i]));
  }
  EXPECT_GT(apart, 1e-5) << "the losses are the float32 pipeline's: autocast did not reach the stages";
  EXPECT_EQ(bf16.bytesSent, float32.bytesSent) << "the wire did not stay float32";
  EXPECT_GT(float32.bytesSent, 0);
}

// float16 would need loss scaling inside step(): refused by every stage at construction, before
// any stage waits for another.
TEST(PipelineHandle, AutocastInFloat16IsRefusedAtConstruction) {
  const auto net = makeNet();
  test::onRanks(2, [&](std::shared_ptr<Communicator> comm) {
    PipelineOptions options{.stages = 2};
    options.autocast = c10::kHalf;
    EXPECT_THROW(Pipeline(Job::fromCommunicator(comm), copyOf(net), torch::zeros({2, 4}), options), InvalidArgument);
  });
}

TEST(PipelineHandle, AJobThatIsNotStagesTimesReplicasIsRefused) {
  const auto net = makeNet();
  test::onRanks(2, [&](std::shared_ptr<Communicator> comm) {
    EXPECT_THROW(Pipeline(Job::fromCommunicator(comm), copyOf(net), torch::zeros({2, 4}), {.stages = 3}),
                 InvalidArgument);
  });
}

}  // namespace
}  // namespace cohort::pipeline_handle_test
