// cohort::Autocast (mixed precision) and --autocast through the schemes that take it: the forward
// pass runs in bfloat16 on every thread that computes one (the replica threads included), while
// the parameters and their gradients stay float32.
#include <cohort/autocast.h>
#include <cohort/error.h>
#include <cohort/job.h>

#include "strategy/strategy.h"
#include "train/trainer.h"

#include <nlohmann/json.hpp>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <limits>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "rank_threads.h"
#include "test_util.h"

namespace cohort::autocast_test {
namespace {

torch::Tensor crossEntropy(const torch::Tensor& out, const torch::Tensor& y) {
  return torch::nn::functional::cross_entropy(out, y);
}

TEST(MixedPrecision, ALinearLayerRunsInBfloat16InsideTheScopeAndFloat32After) {
  torch::manual_seed(1);
  torch::nn::Linear linear(4, 3);
  const torch::Tensor x = torch::randn({2, 4});
  {
    Autocast outer(torch::kCPU);
    EXPECT_EQ(linear->forward(x).scalar_type(), torch::kBFloat16);
    {
      Autocast inner(torch::kCPU);
      EXPECT_EQ(linear->forward(x).scalar_type(), torch::kBFloat16);
    }
    EXPECT_EQ(linear->forward(x).scalar_type(), torch::kBFloat16) << "the inner scope's end turned the outer off";
  }
  EXPECT_EQ(linear->forward(x).scalar_type(), torch::kFloat32);
  EXPECT_EQ(linear->weight.scalar_type(), torch::kFloat32);
}

// Inside a scope autocast keeps the bfloat16 copy of each weight it cast (a Conv2d's: a Linear
// of the C++ frontend casts a transposed view, which is not kept); an optimizer step between two
// forward passes changes the weight in place, so the scope's end must drop the copies, as
// torch.autocast's exit does. Otherwise the next forward pass runs the old weights.
TEST(MixedPrecision, TheOutermostScopesEndDropsTheCastWeights) {
  torch::manual_seed(2);
  torch::nn::Conv2d conv(torch::nn::Conv2dOptions(1, 2, 3));
  const torch::Tensor x = torch::randn({1, 1, 5, 5});
  torch::Tensor before, after;
  {
    Autocast scope(torch::kCPU);
    before = conv->forward(x);
  }
  {
    torch::NoGradGuard noGrad;
    conv->weight.add_(1.0);
  }
  {
    Autocast scope(torch::kCPU);
    after = conv->forward(x);
  }
  const torch::Tensor expected = conv->forward(x);  // float32, the new weights
  EXPECT_FALSE(torch::equal(before, after)) << "the second pass ran the weights cast before the change";
  EXPECT_LT((after.to(torch::kFloat32) - expected).abs().max().item<double>(), 0.1);
}

TEST(MixedPrecision, TheFlagTakesOffBf16AndFp16) {
  EXPECT_FALSE(parseAutocast("off").has_value());
  EXPECT_EQ(parseAutocast("bf16"), c10::kBFloat16);
  EXPECT_EQ(parseAutocast("fp16"), c10::kHalf);
  EXPECT_EQ(autocastName(parseAutocast("bf16")), "bf16");
  EXPECT_EQ(autocastName(parseAutocast("fp16")), "fp16");
  EXPECT_EQ(autocastName(std::nullopt), "off");
  EXPECT_THROW(parseAutocast("bf8"), InvalidArgument);
  EXPECT_THROW(Autocast(torch::kCPU, torch::kFloat32), InvalidArgument);
}

// float16 needs the loss scaler, which sits where a scheme steps its own optimizer.
TEST(MixedPrecision, Float16IsRefusedWhereTheOptimizerIsNotTheSchemesOwn) {
  StrategyOptions options;
  options.autocast = c10::kHalf;
  for (Scheme ok : {Scheme::kLocal, Scheme::kAllreduce, Scheme::kAverage, Scheme::kGossip}) {
    options.scheme = ok;
    EXPECT_NO_THROW(checkAutocastOptions(options)) << schemeName(ok);
  }
  options.scheme = Scheme::kAllreduce;
  options.codec = "topk:0.1";  // its residual would hold scaled gradients
  EXPECT_THROW(checkAutocastOptions(options), InvalidArgument);
  options.codec = "fp16";  // the scaled gradients would saturate float16 on the wire, unseen by the scaler
  try {
    checkAutocastOptions(options);
    ADD_FAILURE() << "--autocast fp16 took --codec fp16 under allreduce";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("--codec bf16"), std::string::npos) << e.what();
  }
  options.codec = "bf16";
  EXPECT_NO_THROW(checkAutocastOptions(options));
  options.scheme = Scheme::kAverage;  // average's codec carries parameter changes, not scaled gradients
  options.codec = "fp16";
  EXPECT_NO_THROW(checkAutocastOptions(options));
  options.scheme = Scheme::kAllreduce;
  options.codec = "none";
  for (Scheme refused :
       {Scheme::kPs, Scheme::kMirrored, Scheme::kCentral, Scheme::kHogwild, Scheme::kPipeline, Scheme::kTensor}) {
    options.scheme = refused;
    try {
      checkAutocastOptions(options);
      ADD_FAILURE() << schemeName(refused) << " took --autocast fp16";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find(std::string("--strategy ") + schemeName(refused)), std::string::npos)
          << e.what();
      EXPECT_NE(std::string(e.what()).find("--autocast bf16"), std::string::npos) << e.what();
    }
    options.autocast = c10::kBFloat16;
    EXPECT_NO_THROW(checkAutocastOptions(options)) << schemeName(refused);
    options.autocast = c10::kHalf;
  }
}

// The scale: gradients divided by it exactly (a power of two), doubled after growthInterval good
// steps, halved and the step refused when a gradient holds an inf.
TEST(MixedPrecision, TheGradScalerUnscalesGrowsAndBacksOff) {
  GradScaler scaler({.initScale = 1024, .growthInterval = 2});
  torch::Tensor p = torch::zeros({2}, torch::requires_grad());
  const auto withGradient = [&](torch::Tensor g) {
    scaler.scale(torch::tensor(1.0f));
    p.mutable_grad() = std::move(g);
    return scaler.unscale({p});
  };
  EXPECT_TRUE(torch::equal(scaler.scale(torch::tensor(3.0f)), torch::tensor(3072.0f)));
  EXPECT_TRUE(withGradient(torch::tensor({2048.0f, -512.0f})));
  EXPECT_TRUE(torch::equal(p.grad(), torch::tensor({2.0f, -0.5f})));
  EXPECT_EQ(scaler.currentScale(), 1024);
  EXPECT_TRUE(withGradient(torch::tensor({1.0f, 1.0f})));
  EXPECT_EQ(scaler.currentScale(), 2048) << "two good steps in a row: growth";
  EXPECT_FALSE(withGradient(torch::tensor({std::numeric_limits<float>::infinity(), 1.0f})));
  EXPECT_EQ(scaler.currentScale(), 1024);
  EXPECT_FALSE(withGradient(torch::tensor({std::nanf(""), 1.0f})));
  EXPECT_EQ(scaler.currentScale(), 512);
  EXPECT_EQ(scaler.skippedSteps(), 2);
  EXPECT_THROW(GradScaler({.backoffFactor = 1.5}), InvalidArgument);
}

// A step is scale() then unscale(): a second unscale() would divide the same gradients again, so
// it throws and leaves them; so does a float16 gradient (Python's refuses it too).
TEST(MixedPrecision, TheGradScalerRefusesASecondUnscaleAndFloat16Gradients) {
  GradScaler scaler({.initScale = 4});
  torch::Tensor p = torch::zeros({2}, torch::requires_grad());
  EXPECT_THROW(scaler.unscale({p}), Error) << "no scale() yet";
  scaler.scale(torch::tensor(1.0f));
  scaler.scale(torch::tensor(2.0f));  // two losses of one step
  p.mutable_grad() = torch::tensor({8.0f, 4.0f});
  EXPECT_TRUE(scaler.unscale({p}));
  try {
    scaler.unscale({p});
    ADD_FAILURE() << "a second unscale() was taken";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("scale(loss).backward()"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(torch::equal(p.grad(), torch::tensor({2.0f, 1.0f}))) << "divided twice";
  torch::Tensor half = torch::zeros({2}, torch::TensorOptions().dtype(torch::kHalf).requires_grad(true));
  half.mutable_grad() = torch::ones({2}, torch::kHalf);
  scaler.scale(torch::tensor(1.0f));
  try {
    scaler.unscale({half});
    ADD_FAILURE() << "a float16 gradient was unscaled";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("float16 gradient"), std::string::npos) << e.what();
  }
}

// state() and loadState(): a scaler given another's state continues as it would have (its next
// growth comes at the same step), and a state no scaler could have is refused.
TEST(MixedPrecision, TheGradScalersStateCarriesItsScaleAndGrowth) {
  GradScaler first({.initScale = 8, .growthInterval = 3});
  torch::Tensor p = torch::zeros({1}, torch::requires_grad());
  const auto goodStep = [&](GradScaler& scaler) {
    scaler.scale(torch::tensor(1.0f));
    p.mutable_grad() = torch::ones({1});
    return scaler.unscale({p});
  };
  first.scale(torch::tensor(1.0f));
  p.mutable_grad() = torch::full({1}, std::numeric_limits<float>::infinity());
  EXPECT_FALSE(first.unscale({p}));
  goodStep(first);
  goodStep(first);
  const GradScalerState saved = first.state();
  EXPECT_EQ(saved.scale, 4);
  EXPECT_EQ(saved.growthTracker, 2);
  EXPECT_EQ(saved.skippedSteps, 1);
  GradScaler second({.initScale = 1024, .growthInterval = 3});
  second.loadState(saved);
  goodStep(first);
  goodStep(second);
  EXPECT_EQ(first.currentScale(), 8) << "the third good step in a row grows";
  EXPECT_EQ(second.currentScale(), 8) << "the loaded scaler did not count the loaded good steps";
  EXPECT_EQ(second.skippedSteps(), 1);
  for (const GradScalerState& bad :
       {GradScalerState{0, 0, 0}, GradScalerState{std::nan(""), 0, 0}, GradScalerState{1e39, 0, 0},
        GradScalerState{1e-300, 0, 0}, GradScalerState{4, 3, 0}, GradScalerState{4, 0, -1}}) {
    EXPECT_THROW(second.loadState(bad), InvalidArgument) << bad.scale << " " << bad.growthTracker;
  }
}

// average's ranks unscale their own gradients, so their scales part (here: rank 1 overflowed
// three times, rank 0 never): a checkpoint keeps every rank's scaler, and each rank resumes with
// its own, not the writer's. (2 ranks as threads; the checkpoint's archive through bytes.)
TEST(MixedPrecision, AverageKeepsEveryRanksLossScalerInTheCheckpoint) {
  const GradScalerState states[2] = {{65536, 5, 0}, {8192, 1, 3}};
  std::vector<char> bytes;
  std::mutex mutex;
  std::vector<GradScalerState> resumed(2);
  StrategyOptions options{.scheme = Scheme::kAverage};
  options.autocast = c10::kHalf;
  test::onRanks(2, [&](std::shared_ptr<Communicator> comm) {
    const int rank = comm->rank();
    const Job job = Job::fromCommunicator(comm);
    {
      torch::manual_seed(1);
      torch::nn::Sequential net(torch::nn::Linear(4, 3));
      torch::optim::SGD optimizer(net->parameters(), 0.1);
      const std::unique_ptr<Strategy> strategy = makeStrategy(options, job);
      strategy->attach(net, optimizer);
      strategy->scaler()->loadState(states[rank]);
      strategy->prepareCheckpoint();  // a collective: every rank
      if (rank == 0) {
        torch::serialize::OutputArchive archive;
        strategy->saveState(archive);
        std::lock_guard<std::mutex> lock(mutex);
        archive.save_to([&](const void* data, size_t size) {
          bytes.insert(bytes.end(), static_cast<const char*>(data), static_cast<const char*>(data) + size);
          return size;
        });
      }
      comm->barrier();
    }
    torch::manual_seed(1);
    torch::nn::Sequential net(torch::nn::Linear(4, 3));
    torch::optim::SGD optimizer(net->parameters(), 0.1);
    const std::unique_ptr<Strategy> strategy = makeStrategy(options, job);
    strategy->attach(net, optimizer);
    torch::serialize::InputArchive archive;
    {
      std::lock_guard<std::mutex> lock(mutex);
      archive.load_from(bytes.data(), bytes.size());
    }
    strategy->loadState(archive);
    std::lock_guard<std::mutex> lock(mutex);
    resumed[size_t(rank)] = strategy->scaler()->state();
  });
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_EQ(resumed[size_t(rank)].scale, states[rank].scale) << "rank " << rank;
    EXPECT_EQ(resumed[size_t(rank)].growthTracker, states[rank].growthTracker) << "rank " << rank;
    EXPECT_EQ(resumed[size_t(rank)].skippedSteps, states[rank].skippedSteps) << "rank " << rank;
  }
}

// --autocast fp16 under local and allreduce: a step whose scaled gradient overflows float16 in
// backward (the loss x 1000 x 65536 is finite in float32, its gradient at the float16 logits is
// not) leaves the parameters as they were and halves the scale; the next, normal, step trains.
// Without autocast the same gradients are finite float32 and the step would be taken.
TEST(MixedPrecision, Float16SkipsTheStepWhoseScaledGradientsOverflow) {
  for (Scheme scheme : {Scheme::kLocal, Scheme::kAllreduce}) {
    torch::manual_seed(5);
    torch::nn::Sequential net(torch::nn::Linear(4, 3));
    torch::optim::SGD optimizer(net->parameters(), 0.1);
    StrategyOptions options{.scheme = scheme};
    options.autocast = c10::kHalf;
    const std::unique_ptr<Strategy> strategy = makeStrategy(options, Job::single());
    strategy->attach(net, optimizer);
    ASSERT_NE(strategy->scaler(), nullptr);
    Batch batch{torch::randn({8, 4}), torch::randint(0, 3, {8})};
    const torch::Tensor before = net[0]->as<torch::nn::LinearImpl>()->weight.detach().clone();
    c10::ScalarType seen = torch::kFloat32;
    const auto huge = [&](const torch::Tensor& out, const torch::Tensor& y) {
      seen = out.scalar_type();
      return crossEntropy(out, y) * 1000.0;
    };
    strategy->step(batch, huge);
    const torch::Tensor& weight = net[0]->as<torch::nn::LinearImpl>()->weight;
    EXPECT_EQ(seen, torch::kHalf) << schemeName(scheme);
    EXPECT_TRUE(torch::equal(weight, before)) << schemeName(scheme) << ": the overflowing step moved the model";
    EXPECT_EQ(strategy->scaler()->skippedSteps(), 1) << schemeName(scheme);
    EXPECT_EQ(strategy->scaler()->currentScale(), 32768) << schemeName(scheme);
    strategy->step(batch, crossEntropy);
    EXPECT_FALSE(torch::equal(weight, before)) << schemeName(scheme) << ": the normal step did not train";
    EXPECT_EQ(strategy->scaler()->skippedSteps(), 1) << schemeName(scheme);
    strategy->finish();
  }
}

// Records the dtype of what reaches it, on whichever thread runs the forward pass; its clones
// (the replica threads' models) share the record.
struct ProbeImpl : torch::nn::Cloneable<ProbeImpl> {
  struct Record {
    std::mutex mutex;
    std::vector<c10::ScalarType> seen;
  };
  explicit ProbeImpl(std::shared_ptr<Record> record) : record(std::move(record)) {}
  void reset() override {}
  torch::Tensor forward(const torch::Tensor& x) {
    std::lock_guard<std::mutex> lock(record->mutex);
    record->seen.push_back(x.scalar_type());
    return x;
  }
  std::shared_ptr<Record> record;
};
TORCH_MODULE(Probe);

// One step of `scheme` in this process with --autocast bf16: every forward pass (one per replica
// thread for the in-process schemes) saw a bfloat16 activation; the parameters are float32 still.
// Without --autocast, float32.
TEST(MixedPrecision, EverySchemeOfOneProcessRunsItsForwardPassesUnderIt) {
  for (Scheme scheme : {Scheme::kLocal, Scheme::kAllreduce, Scheme::kMirrored, Scheme::kCentral, Scheme::kHogwild}) {
    for (const bool on : {true, false}) {
      torch::manual_seed(3);
      auto record = std::make_shared<ProbeImpl::Record>();
      torch::nn::Sequential net(torch::nn::Linear(4, 8), Probe(record), torch::nn::ReLU(), torch::nn::Linear(8, 3));
      torch::optim::SGD optimizer(net->parameters(), 0.1);
      StrategyOptions options{.scheme = scheme};
      options.replicas = 2;
      if (on) options.autocast = c10::kBFloat16;
      const std::unique_ptr<Strategy> strategy = makeStrategy(options, Job::single());
      strategy->attach(net, optimizer);
      Batch batch{torch::randn({8, 4}), torch::randint(0, 3, {8})};
      strategy->step(batch, crossEntropy);
      strategy->finish();
      const std::string what = std::string(schemeName(scheme)) + (on ? " under --autocast bf16" : " without it");
      ASSERT_FALSE(record->seen.empty()) << what;
      for (c10::ScalarType seen : record->seen) {
        EXPECT_EQ(seen, on ? torch::kBFloat16 : torch::kFloat32) << what;
      }
      for (const auto& p : net->parameters()) EXPECT_EQ(p.scalar_type(), torch::kFloat32) << what;
    }
  }
}

// `cohort train --autocast bf16` in one process: the done event says so, the model is float32,
// and it learns as the float32 run does (a cnn on synthetic data: both well above chance, within a
// few points of each other), along another path (the parameters differ).
TEST(MixedPrecision, TheTrainerRunsUnderItAndLearnsAsInFloat32) {
  test::TempDir dir;
  const auto train = [&](std::optional<c10::ScalarType> autocast, const std::string& name) {
    TrainOptions o;
    o.model = "cnn";
    o.data = "synthetic:1280";
    o.batch = 32;
    o.steps = 60;
    o.threads = 1;
    o.progress = ProgressMode::kOff;
    o.strategy.autocast = autocast;
    o.metricsPath = dir.file(name + ".jsonl");
    Trainer trainer(o);
    const TrainResult result = trainer.run();
    const auto done = nlohmann::json::parse(test::lines(test::readFile(o.metricsPath)).back());
    EXPECT_EQ(done.value("autocast", ""), autocastName(autocast));
    std::vector<torch::Tensor> params;
    for (const auto& p : trainer.model()->parameters()) {
      EXPECT_EQ(p.scalar_type(), torch::kFloat32);
      params.push_back(p.detach().clone());
    }
    return std::make_pair(result.testAccuracy, params);
  };
  const auto [float32, float32Params] = train(std::nullopt, "off");
  const auto [bf16, bf16Params] = train(c10::kBFloat16, "bf16");
  EXPECT_GT(float32, 0.5);
  EXPECT_NEAR(bf16, float32, 0.05);
  EXPECT_FALSE(torch::equal(bf16Params.front(), float32Params.front())) << "--autocast bf16 changed nothing";
}

}  // namespace
}  // namespace cohort::autocast_test
