// The pipeline handle used directly (include/cohort/pipeline.h), ranks as threads: two stages,
// under either schedule and with a layer split between them, train as one process does on the
// whole batch, and a job that does not fit the stages is refused; frozen parameters stay frozen
// through a split layer, the stages' replicas and TensorParallel's ways; a bad batch, or stages
// given batches of different sizes, are refused.
#include <cohort/autocast.h>
#include <cohort/error.h>
#include <cohort/job.h>
#include <cohort/pipeline.h>
#include <cohort/tensor_parallel.h>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <map>
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

// Sets requires_grad false on the named parameters ("0.bias"). Before copyOf, which does not
// keep the flag.
torch::nn::Sequential frozen(torch::nn::Sequential net, const std::vector<std::string>& names) {
  auto params = net->named_parameters();
  for (const auto& name : names) params[name].requires_grad_(false);
  return net;
}

// Each parameter's requires_grad, by name.
std::map<std::string, bool> requiresGrad(torch::nn::Module& m) {
  std::map<std::string, bool> out;
  for (const auto& p : m.named_parameters()) out[p.key()] = p.value().requires_grad();
  return out;
}

// A frozen layer (requires_grad false) stays frozen in its parts: a layer split between two
// stages made its parts' weight and bias trainable.
TEST(PipelineHandle, AFrozenLayerSplitBetweenStagesStaysFrozen) {
  const auto net = makeNet();
  torch::manual_seed(4);
  const auto x = torch::randn({6, 4});
  const auto y = torch::randint(0, 3, {6}, torch::kLong);
  const torch::Tensor weight = net->named_parameters()["2.weight"].detach().clone();
  test::onRanks(2, [&](std::shared_ptr<Communicator> comm) {
    Pipeline pipe(Job::fromCommunicator(comm), frozen(copyOf(net), {"2.weight", "0.bias"}), x,
                  {.stages = 2, .microBatches = 2, .partition = "2+1,1"});
    const auto flags = requiresGrad(*pipe.module());
    if (comm->rank() == 0) {
      EXPECT_EQ(flags, (std::map<std::string, bool>{
                           {"0.weight", true}, {"0.bias", false}, {"2.weight", false}, {"2.bias", true}}));
    } else {
      EXPECT_EQ(flags, (std::map<std::string, bool>{{"2.weight", false}, {"2.bias", true}}));
    }
    torch::optim::SGD opt(pipe.module()->parameters(), torch::optim::SGDOptions(0.1).weight_decay(0.1));
    for (int i = 0; i < kSteps; ++i) pipe.step(x, y, crossEntropy, opt);
    const torch::Tensor part = pipe.module()->named_parameters()["2.weight"];
    const torch::Tensor rows = comm->rank() == 0 ? weight.narrow(0, 0, 1) : weight.narrow(0, 1, 2);
    EXPECT_TRUE(torch::equal(part, rows)) << "rank " << comm->rank() << " moved a frozen weight";
    pipe.finish();
  });
}

// Passes its input through; its parameter gets no gradient.
struct UnusedParameterImpl : torch::nn::Cloneable<UnusedParameterImpl> {
  UnusedParameterImpl() { reset(); }
  void reset() override { extra = register_parameter("extra", torch::ones({3})); }
  torch::Tensor forward(const torch::Tensor& x) { return x; }
  torch::Tensor extra;
};
TORCH_MODULE(UnusedParameter);

// Two stages x two replicas, SGD with weight decay: a frozen parameter and one no replica got a
// gradient for stay where they were and keep no gradient, as in one process (the stages'
// average gave every parameter without a gradient zeros, which weight decay then moved).
TEST(PipelineHandle, ReplicasLeaveFrozenAndUnusedParametersAlone) {
  auto net = makeNet();
  net->push_back(UnusedParameter());  // layer 3 (clone() names the layers by their index)
  const torch::Tensor bias = net->named_parameters()["0.bias"].detach().clone();
  test::onRanks(4, [&](std::shared_ptr<Communicator> comm) {
    torch::manual_seed(10 + comm->rank() / 2);  // each replica its own batch
    const auto x = torch::randn({6, 4});
    const auto y = torch::randint(0, 3, {6}, torch::kLong);
    Pipeline pipe(Job::fromCommunicator(comm), frozen(copyOf(net), {"0.bias"}), x,
                  {.stages = 2, .replicas = 2, .microBatches = 2, .partition = "2,2"});
    torch::optim::SGD opt(pipe.module()->parameters(), torch::optim::SGDOptions(0.1).weight_decay(0.1).momentum(0.9));
    for (int i = 0; i < kSteps; ++i) pipe.step(x, y, crossEntropy, opt);
    auto params = pipe.module()->named_parameters();
    if (pipe.stage() == 0) {
      EXPECT_TRUE(torch::equal(params["0.bias"], bias)) << "rank " << comm->rank() << " moved a frozen bias";
      EXPECT_FALSE(params["0.bias"].grad().defined());
      EXPECT_TRUE(params["0.weight"].grad().defined());
    } else {
      EXPECT_TRUE(torch::equal(params["3.extra"], torch::ones({3})))
          << "rank " << comm->rank() << " moved a parameter no replica had a gradient for";
      EXPECT_FALSE(params["3.extra"].grad().defined());
      EXPECT_TRUE(params["2.weight"].grad().defined());
    }
    pipe.finish();
  });
}

// An empty batch (micro-batches of no examples divided by zero: SIGSEGV), or targets of another
// size than the inputs, is refused by every stage before any message.
TEST(PipelineHandle, AnEmptyBatchOrMismatchedTargetsAreRefused) {
  const auto net = makeNet();
  test::onRanks(2, [&](std::shared_ptr<Communicator> comm) {
    Pipeline pipe(Job::fromCommunicator(comm), copyOf(net), torch::zeros({4, 4}), {.stages = 2, .partition = "1,2"});
    torch::optim::SGD opt(pipe.module()->parameters(), 0.1);
    const auto y = torch::zeros({4}, torch::kLong);
    EXPECT_THROW(pipe.step(torch::zeros({0, 4}), torch::zeros({0}, torch::kLong), crossEntropy, opt), InvalidArgument);
    EXPECT_THROW(pipe.step(torch::zeros({4, 4}), torch::zeros({3}, torch::kLong), crossEntropy, opt), InvalidArgument);
    pipe.step(torch::zeros({4, 4}), y, crossEntropy, opt);  // the pipeline still works
    pipe.finish();
  });
}

// A library user's mistake: the stages given batches of different sizes. The later stage sized its
// receives for its own batch, and Gloo aborted the process on the first message (EnforceNotMet in
// its thread); now that stage throws InvalidArgument naming both sizes, and the other fails as a
// peer lost. The same in infer().
TEST(PipelineHandle, StagesGivenBatchesOfDifferentSizesAreRefused) {
  const auto net = makeNet();
  for (const bool infer : {false, true}) {
    SCOPED_TRACE(infer ? "infer" : "step");
    test::onRanks(2, [&](std::shared_ptr<Communicator> comm) {
      Pipeline pipe(Job::fromCommunicator(comm), copyOf(net), torch::zeros({6, 4}), {.stages = 2, .partition = "1,2"});
      torch::optim::SGD opt(pipe.module()->parameters(), 0.1);
      const int64_t n = comm->rank() == 0 ? 6 : 4;
      auto run = [&] {
        if (infer) {
          pipe.infer(torch::zeros({n, 4}));
        } else {
          pipe.step(torch::zeros({n, 4}), torch::zeros({n}, torch::kLong), crossEntropy, opt);
        }
      };
      if (comm->rank() == 1) {
        try {
          run();
          ADD_FAILURE() << "no error";
        } catch (const InvalidArgument& e) {
          EXPECT_NE(std::string(e.what()).find("stage 1 was given a batch of 4 examples and stage 0 (rank 0) one of 6"),
                    std::string::npos)
              << e.what();
        }
      } else {
        EXPECT_THROW(run(), Error);
      }
    });
  }
}

// TensorParallel: the parts of a frozen layer stay frozen (the column half, the row half, and
// the bias added after the sum); a trainable one stays trainable.
TEST(PipelineHandle, TensorParallelKeepsFrozenLayersFrozen) {
  const auto net = makeNet();
  test::onRanks(2, [&](std::shared_ptr<Communicator> comm) {
    TensorParallel tp(Job::fromCommunicator(comm), frozen(copyOf(net), {"0.weight", "0.bias", "2.bias"}),
                      torch::zeros({2, 4}), {.ways = 2});
    EXPECT_EQ(requiresGrad(*tp.module()),
              (std::map<std::string, bool>{
                  {"0.weight", false}, {"0.bias", false}, {"2.weight", true}, {"2_sum.bias", false}}))
        << tp.plan();
  });
}

}  // namespace
}  // namespace cohort::pipeline_handle_test
