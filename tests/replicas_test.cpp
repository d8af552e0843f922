// Replicas as threads of one process (include/cohort/replicas.h), and averaging's outer optimizer.
#include <cohort/autocast.h>
#include <cohort/averaging.h>
#include <cohort/data_parallel.h>
#include <cohort/error.h>
#include <cohort/job.h>
#include <cohort/models.h>
#include <cohort/replicas.h>
#include <cohort/tensor_parallel.h>

#include "schemes/model_sync.h"
#include "strategy/replicas.h"

#include <gtest/gtest.h>

#include <mutex>
#include <nlohmann/json.hpp>
#include <torch/script.h>
#include <torch/torch.h>

#include <atomic>
#include <chrono>
#include <optional>
#include <thread>

#include "rank_threads.h"
#include "test_util.h"

namespace cohort::replicas_test {
namespace {

namespace nn = torch::nn;

// Uneven widths on purpose (7 units do not split evenly over 2 or 3).
// Ranks run as threads here: the global generator is seeded and drawn from under a lock, so every
// thread's net of one seed is the same.
nn::Sequential smallNet(uint64_t seed) {
  static std::mutex generator;
  std::lock_guard<std::mutex> lock(generator);
  torch::manual_seed(seed);
  return nn::Sequential(nn::Conv2d(nn::Conv2dOptions(1, 3, 3)), nn::ReLU(), nn::Flatten(), nn::Linear(3 * 4 * 4, 7),
                        nn::ReLU(), nn::Linear(7, 5));
}

torch::Tensor crossEntropy(nn::Module& m, const torch::Tensor& x, const torch::Tensor& y) {
  return nn::functional::cross_entropy(m.as<nn::SequentialImpl>()->forward(x), y);
}

const ShardLoss kLoss = [](int, nn::Module& m, const torch::Tensor& x, const torch::Tensor& y) {
  return crossEntropy(m, x, y);
};

std::vector<torch::Tensor> parametersOf(nn::Module& m) {
  std::vector<torch::Tensor> out;
  for (auto& p : m.parameters()) out.push_back(p.detach().clone());
  return out;
}

double maxDifference(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  EXPECT_EQ(a.size(), b.size());
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) worst = std::max(worst, (a[i] - b[i]).abs().max().item<double>());
  return worst;
}

bool identical(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!torch::equal(a[i], b[i])) return false;
  }
  return true;
}

struct Data {
  std::vector<torch::Tensor> x, y;
};

Data batches(int steps, int64_t n) {
  torch::manual_seed(99);
  Data d;
  for (int i = 0; i < steps; ++i) {
    d.x.push_back(torch::randn({n, 1, 6, 6}));
    d.y.push_back(torch::randint(0, 5, {n}));
  }
  return d;
}

// One process, plain SGD on each whole batch: the reference (by default on smallNet(1)).
std::vector<torch::Tensor> trainAlone(const Data& d, double lr, nn::Sequential net = smallNet(1)) {
  torch::optim::SGD opt(net->parameters(), lr);
  for (size_t i = 0; i < d.x.size(); ++i) {
    opt.zero_grad();
    crossEntropy(*net, d.x[i], d.y[i]).backward();
    opt.step();
  }
  return parametersOf(*net);
}

enum class Scheme { kMirrored, kCentral, kHogwild };

std::unique_ptr<ReplicaGroup> makeGroup(Scheme scheme, nn::Sequential net, torch::optim::Optimizer& opt,
                                        ReplicaOptions options) {
  switch (scheme) {
    case Scheme::kMirrored: return std::make_unique<Mirrored>(net.ptr(), opt, options);
    case Scheme::kCentral: return std::make_unique<CentralStorage>(net.ptr(), opt, options);
    case Scheme::kHogwild: return std::make_unique<Hogwild>(net.ptr(), opt, options);
  }
  return nullptr;
}

class SumsLikeOneProcess : public ::testing::TestWithParam<std::tuple<Scheme, int, int64_t, bool>> {};

// Mirrored and CentralStorage: a step on R replicas equals one process's step on the whole batch
// (uneven shards included), with tiny buckets so that many are summed while backward runs.
TEST_P(SumsLikeOneProcess, EqualsOneProcessOnTheWholeBatch) {
  const auto [scheme, R, n, overlap] = GetParam();
  const Data d = batches(6, n);
  const auto expected = trainAlone(d, 0.1);
  auto net = smallNet(1);
  torch::optim::SGD opt(net->parameters(), 0.1);
  auto group = makeGroup(scheme, net, opt, {.replicas = R, .bucketMb = 0.0002, .overlap = overlap});
  for (size_t i = 0; i < d.x.size(); ++i) group->step(d.x[i], d.y[i], kLoss);
  EXPECT_LT(maxDifference(parametersOf(*net), expected), 1e-5);
  for (int r = 1; r < R; ++r) EXPECT_TRUE(identical(parametersOf(group->replica(r)), parametersOf(*net))) << r;
  EXPECT_EQ(group->stats().steps, 6);
}

INSTANTIATE_TEST_SUITE_P(Replicas, SumsLikeOneProcess,
                         ::testing::Values(std::make_tuple(Scheme::kMirrored, 2, int64_t(12), true),
                                           std::make_tuple(Scheme::kMirrored, 3, int64_t(11), true),
                                           std::make_tuple(Scheme::kMirrored, 3, int64_t(11), false),
                                           std::make_tuple(Scheme::kCentral, 2, int64_t(12), true),
                                           std::make_tuple(Scheme::kCentral, 3, int64_t(13), true)));

// Momentum and weight decay on every replica's copy of the optimizer: the copies stay bit-identical.
TEST(Mirrored, ReplicasStayBitIdenticalWithMomentum) {
  const Data d = batches(8, 16);
  auto net = smallNet(3);
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9).weight_decay(1e-4));
  Mirrored mirrored(net.ptr(), opt, {.replicas = 3, .bucketMb = 0.0005});
  for (size_t i = 0; i < d.x.size(); ++i) mirrored.step(d.x[i], d.y[i], kLoss);
  for (int r = 1; r < 3; ++r) EXPECT_TRUE(identical(parametersOf(mirrored.replica(r)), parametersOf(*net))) << r;
  // Every replica's copy, and not only replica 0, is trained (the copies are deep).
  EXPECT_NE(mirrored.replica(1).parameters()[0].data_ptr(), net->parameters()[0].data_ptr());
}

// A schedule that changes the caller's learning rate (here to 0 after the first steps) reaches
// every replica's copy of the optimizer: they stay bit-identical (the copies kept the first lr).
TEST(Mirrored, ALearningRateChangedBetweenStepsReachesEveryReplica) {
  const Data d = batches(6, 12);
  auto net = smallNet(3);
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  Mirrored mirrored(net.ptr(), opt, {.replicas = 2, .bucketMb = 0.0005});
  for (size_t i = 0; i < d.x.size(); ++i) {
    if (i == 3) opt.param_groups()[0].options().set_lr(0.01);
    mirrored.step(d.x[i], d.y[i], kLoss);
  }
  EXPECT_TRUE(identical(parametersOf(mirrored.replica(1)), parametersOf(*net)));
  opt.add_param_group(torch::optim::OptimizerParamGroup({torch::zeros({1}, torch::requires_grad())}));
  EXPECT_THROW(mirrored.step(d.x[0], d.y[0], kLoss), InvalidArgument);
}

// A TorchScript layer (cohort's ScriptedLayer) is copied deeply, and trains like one process.
TEST(Mirrored, CopiesTorchScriptLayers) {
  test::TempDir dir;
  torch::manual_seed(5);
  torch::jit::Module script("Affine");
  script.register_parameter("weight", torch::randn({4, 3}).requires_grad_(), false);
  script.register_parameter("bias", torch::zeros({3}).requires_grad_(), false);
  script.define("def forward(self, x):\n  return x.matmul(self.weight) + self.bias\n");
  script.save(dir.file("affine.pt"));
  auto alone = loadScriptedModel(dir.file("affine.pt"));
  auto net = loadScriptedModel(dir.file("affine.pt"));
  torch::manual_seed(6);
  auto x = torch::randn({10, 4});
  auto y = torch::randint(0, 3, {10});
  torch::optim::SGD aloneOpt(alone->parameters(), 0.5);
  torch::optim::SGD opt(net->parameters(), 0.5);
  Mirrored mirrored(net.ptr(), opt, {.replicas = 2});
  for (int i = 0; i < 4; ++i) {
    aloneOpt.zero_grad();
    crossEntropy(*alone, x, y).backward();
    aloneOpt.step();
    mirrored.step(x, y, kLoss);
  }
  EXPECT_LT(maxDifference(parametersOf(*net), parametersOf(*alone)), 1e-5);
  EXPECT_TRUE(identical(parametersOf(mirrored.replica(1)), parametersOf(*net)));
  EXPECT_NE(mirrored.replica(1).parameters()[0].data_ptr(), net->parameters()[0].data_ptr());
}

class ThrowingReplica : public ::testing::TestWithParam<Scheme> {};

// A replica whose loss throws ends the step on every thread with its error, the parameters
// untouched, and the next step works.
TEST_P(ThrowingReplica, EndsTheStepWithItsError) {
  const Data d = batches(2, 12);
  auto net = smallNet(1);
  torch::optim::SGD opt(net->parameters(), 0.1);
  auto group = makeGroup(GetParam(), net, opt, {.replicas = 3, .timeout = std::chrono::seconds(20)});
  const auto before = parametersOf(*net);
  std::atomic<bool> throwNow{true};
  const ShardLoss loss = [&](int replica, nn::Module& m, const torch::Tensor& x, const torch::Tensor& y) {
    if (replica == 1 && throwNow) throw std::runtime_error("replica one is broken");
    return crossEntropy(m, x, y);
  };
  try {
    group->step(d.x[0], d.y[0], loss);
    FAIL() << "the step did not throw";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("replica 1 failed: replica one is broken"), std::string::npos) << e.what();
  }
  if (GetParam() != Scheme::kHogwild) EXPECT_TRUE(identical(parametersOf(*net), before));
  throwNow = false;
  group->step(d.x[1], d.y[1], loss);
  EXPECT_FALSE(identical(parametersOf(*net), before));
  for (int r = 1; r < 3; ++r) EXPECT_TRUE(identical(parametersOf(group->replica(r)), parametersOf(*net))) << r;
}

INSTANTIATE_TEST_SUITE_P(Replicas, ThrowingReplica,
                         ::testing::Values(Scheme::kMirrored, Scheme::kCentral, Scheme::kHogwild));

class FrozenParameter : public ::testing::TestWithParam<Scheme> {};

// A parameter that does not require its gradient (a frozen layer) stays frozen in every replica's
// copy, and keeps its value: torch's Module::clone() gives a copy's parameters requires_grad as a
// new layer's, so the copies had one more trainable parameter than the model (the handle refused
// it) or trained the frozen one.
TEST_P(FrozenParameter, StaysFrozenInEveryReplica) {
  const Data d = batches(3, 12);
  auto alone = smallNet(1);
  alone[0]->as<nn::Conv2dImpl>()->weight.requires_grad_(false);
  const auto expected = trainAlone(d, 0.1, alone);
  auto net = smallNet(1);
  const auto frozen = net[0]->as<nn::Conv2dImpl>()->weight.requires_grad_(false);
  const auto frozenBefore = frozen.detach().clone();
  std::vector<torch::Tensor> trainable;
  for (const auto& p : net->parameters()) {
    if (p.requires_grad()) trainable.push_back(p);
  }
  torch::optim::SGD opt(trainable, 0.1);
  auto group = makeGroup(GetParam(), net, opt, {.replicas = 3});
  for (size_t i = 0; i < d.x.size(); ++i) group->step(d.x[i], d.y[i], kLoss);
  for (int r = 0; r < 3; ++r) {
    auto& copy = *group->replica(r).as<nn::SequentialImpl>();
    const auto weight = copy[0]->as<nn::Conv2dImpl>()->weight;
    EXPECT_FALSE(weight.requires_grad()) << "replica " << r;
    EXPECT_TRUE(torch::equal(weight, frozenBefore)) << "replica " << r;
    EXPECT_TRUE(copy[0]->as<nn::Conv2dImpl>()->bias.requires_grad()) << "replica " << r;
  }
  // Hogwild's replicas apply their updates in no set order: it trained, with the frozen weight kept.
  if (GetParam() != Scheme::kHogwild) EXPECT_LT(maxDifference(parametersOf(*net), expected), 1e-5);
  EXPECT_GT(maxDifference(parametersOf(*net), parametersOf(*smallNet(1))), 1e-3);
}

INSTANTIATE_TEST_SUITE_P(Replicas, FrozenParameter,
                         ::testing::Values(Scheme::kMirrored, Scheme::kCentral, Scheme::kHogwild));

class BatchNormBuffers : public ::testing::TestWithParam<Scheme> {};

// BatchNorm's running statistics under replicas, against one process on the whole batches: the
// running mean is the same (up to rounding), the running variance near it (each replica's batch
// variance is of its shard), the batches seen are the steps. CentralStorage and Hogwild keep one
// set of buffers, each step's the replicas' updates weighted by their shards; Mirrored's replicas
// keep their own until synchronizeBuffers. (CentralStorage's and Hogwild's replicas shared the
// model's buffers: every replica's forward updated them, concurrently, once per replica and step.)
// A learning rate of 0: the running statistics depend on the batches only, also under Hogwild.
TEST_P(BatchNormBuffers, RunningStatisticsAreOneProcesssOnTheWholeBatches) {
  const Data d = batches(4, 12);
  auto make = [] {
    torch::manual_seed(7);
    return nn::Sequential(nn::Conv2d(nn::Conv2dOptions(1, 3, 3)), nn::BatchNorm2d(3), nn::ReLU(), nn::Flatten(),
                          nn::Linear(3 * 4 * 4, 5));
  };
  auto alone = make();
  trainAlone(d, 0.0, alone);
  auto net = make();
  torch::optim::SGD opt(net->parameters(), 0.0);
  auto group = makeGroup(GetParam(), net, opt, {.replicas = 3});
  for (size_t i = 0; i < d.x.size(); ++i) group->step(d.x[i], d.y[i], kLoss);
  group->synchronizeBuffers();
  const auto& expected = *alone[1]->as<nn::BatchNorm2dImpl>();
  for (int r = 0; r < 3; ++r) {
    const auto& bn = *group->replica(r).as<nn::SequentialImpl>()->ptr(1)->as<nn::BatchNorm2dImpl>();
    EXPECT_LT((bn.running_mean - expected.running_mean).abs().max().item<double>(), 1e-6) << "replica " << r;
    EXPECT_LT((bn.running_var - expected.running_var).abs().max().item<double>(), 0.05) << "replica " << r;
    EXPECT_EQ(bn.num_batches_tracked.item<int64_t>(), 4) << "replica " << r;
  }
}

INSTANTIATE_TEST_SUITE_P(Replicas, BatchNormBuffers,
                         ::testing::Values(Scheme::kMirrored, Scheme::kCentral, Scheme::kHogwild));

// One intra-op thread per replica whatever the process's count: ATen's lazy per-thread
// initialization would otherwise give each replica thread the process-wide count at its first
// parallel operation.
TEST(Replicas, EachReplicaRunsOneIntraOpThread) {
  const int before = at::get_num_threads();
  at::set_num_threads(2);
  auto net = smallNet(1);
  torch::optim::SGD opt(net->parameters(), 0.1);
  std::vector<int> seen(2, -1);
  {
    Mirrored mirrored(net.ptr(), opt, {.replicas = 2});
    const Data d = batches(1, 8);
    mirrored.step(d.x[0], d.y[0], [&](int r, nn::Module& m, const torch::Tensor& x, const torch::Tensor& y) {
      seen[size_t(r)] = at::get_num_threads();
      return kLoss(r, m, x, y);
    });
  }
  at::set_num_threads(before);
  EXPECT_EQ(seen, (std::vector<int>{1, 1}));
}

// An epoch's last batch may hold fewer examples than there are replicas: those without one add
// zeros, and the step still equals one process on that batch (it failed the run, after its epoch,
// asking for a --batch the run already had).
TEST(Replicas, ABatchSmallerThanTheReplicasLeavesSomeWithout) {
  for (const Scheme scheme : {Scheme::kMirrored, Scheme::kCentral}) {
    const Data d = batches(2, 2);
    const auto expected = trainAlone(d, 0.1);
    auto net = smallNet(1);
    torch::optim::SGD opt(net->parameters(), 0.1);
    auto group = makeGroup(scheme, net, opt, {.replicas = 3});
    for (size_t i = 0; i < d.x.size(); ++i) group->step(d.x[i], d.y[i], kLoss);
    EXPECT_EQ(group->stats().lastShards, (std::vector<int64_t>{1, 1, 0}));
    EXPECT_LT(maxDifference(parametersOf(*net), expected), 1e-5);
  }
}

// The timeout bounds each wait of a replica for another, not the step: a step whose replicas each
// compute for longer than it (a large batch) is no failure. (Its deadline was the step's start plus
// the timeout, so every wait after such a compute failed at once, blaming a stuck replica.)
TEST(Replicas, AStepLongerThanTheTimeoutIsNoFailure) {
  const Data d = batches(1, 4);
  auto net = smallNet(1);
  torch::optim::SGD opt(net->parameters(), 0.1);
  Mirrored mirrored(net.ptr(), opt, {.replicas = 2, .timeout = std::chrono::milliseconds(200)});
  EXPECT_NO_THROW(
      mirrored.step(d.x[0], d.y[0], [&](int r, nn::Module& m, const torch::Tensor& x, const torch::Tensor& y) {
        std::this_thread::sleep_for(std::chrono::milliseconds(400));  // the work: both replicas alike
        return kLoss(r, m, x, y);
      }));
}

// With --balance-shards, a batch whose rest over the split's unit (n mod max(1, n / 32)) is more
// than the replicas lost the examples beyond one each: 135 over 2 replicas trained on 134.
TEST(Replicas, BalancedShardsKeepEveryExample) {
  constexpr int64_t n = 135;
  const Data d = batches(4, n);
  const auto expected = trainAlone(d, 0.1);
  auto net = smallNet(1);
  torch::optim::SGD opt(net->parameters(), 0.1);
  auto group = makeGroup(Scheme::kMirrored, net, opt, {.replicas = 2, .balance = true});
  for (size_t i = 0; i < d.x.size(); ++i) {
    group->step(d.x[i], d.y[i], [&](int r, nn::Module& m, const torch::Tensor& x, const torch::Tensor& y) {
      if (r == 1) std::this_thread::sleep_for(std::chrono::microseconds(500 * x.size(0)));  // a slower core
      return kLoss(r, m, x, y);
    });
    const auto& shards = group->stats().lastShards;
    EXPECT_EQ(shards[0] + shards[1], n) << "step " << i;
  }
  EXPECT_NE(group->stats().lastShards[0], group->stats().lastShards[1]) << "the split was not balanced";
  EXPECT_LT(maxDifference(parametersOf(*net), expected), 1e-5);
}

// --balance-shards: the last replica is made slow (it sleeps 3 ms per example of its shard, as a
// core three times slower would; the sleep is its work, not a synchronization), so the split moves
// the batch to the others within a few steps: the slow one keeps about the floor of max(1, n / 4R)
// examples. The step still equals one process on the whole batch, the copies stay bit-identical.
class BalancedShards : public ::testing::TestWithParam<std::tuple<Scheme, int>> {};

TEST_P(BalancedShards, MoveExamplesFromASlowReplicaAndStillEqualOneProcess) {
  const auto [scheme, R] = GetParam();
  constexpr int64_t n = 16;
  const Data d = batches(8, n);
  const auto expected = trainAlone(d, 0.1);
  auto net = smallNet(1);
  torch::optim::SGD opt(net->parameters(), 0.1);
  auto group = makeGroup(scheme, net, opt, {.replicas = R, .balance = true});
  std::vector<std::vector<int64_t>> seen(d.x.size(), std::vector<int64_t>(size_t(R), 0));
  for (size_t i = 0; i < d.x.size(); ++i) {
    group->step(d.x[i], d.y[i], [&, i](int r, nn::Module& m, const torch::Tensor& x, const torch::Tensor& y) {
      seen[i][size_t(r)] = x.size(0);
      if (r == R - 1) std::this_thread::sleep_for(std::chrono::milliseconds(3 * x.size(0)));
      return kLoss(r, m, x, y);
    });
    int64_t total = 0;
    for (int64_t examples : seen[i]) total += examples;
    EXPECT_EQ(total, n) << "step " << i;
    EXPECT_EQ(group->stats().lastShards, seen[i]) << "step " << i;
  }
  // The first step, before any measurement, is even.
  for (int r = 0; r < R; ++r) EXPECT_LE(std::abs(seen[0][size_t(r)] - n / R), 1) << r;
  const int64_t floor = std::max<int64_t>(1, n / (4 * R));
  const auto& last = seen.back();
  EXPECT_GE(last[size_t(R - 1)], floor);
  EXPECT_LE(last[size_t(R - 1)], floor + 2) << "the slow replica kept " << last[size_t(R - 1)] << " of " << n;
  EXPECT_LT(maxDifference(parametersOf(*net), expected), 1e-5);
  for (int r = 1; r < R; ++r) EXPECT_TRUE(identical(parametersOf(group->replica(r)), parametersOf(*net))) << r;
}

INSTANTIATE_TEST_SUITE_P(Replicas, BalancedShards,
                         ::testing::Values(std::make_tuple(Scheme::kMirrored, 2), std::make_tuple(Scheme::kMirrored, 3),
                                           std::make_tuple(Scheme::kCentral, 2)));

TEST(Replicas, HogwildRefusesBalance) {
  auto net = smallNet(1);
  torch::optim::SGD opt(net->parameters(), 0.1);
  try {
    Hogwild hogwild(net.ptr(), opt, {.replicas = 2, .balance = true});
    FAIL() << "no error";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("balance applies to Mirrored and CentralStorage"), std::string::npos)
        << e.what();
  }
}

TEST(Replicas, RefuseAnOptimizerTheyCannotCopy) {
  auto net = smallNet(1);
  torch::optim::LBFGS opt(net->parameters());
  EXPECT_THROW(Mirrored(net.ptr(), opt, {.replicas = 2}), InvalidArgument);
}

// Hogwild: one parameter set written by every thread; updates, staleness and conflicts counted.
TEST(Hogwild, SharesOneParameterSetAndCountsItsUpdates) {
  const Data d = batches(10, 12);
  auto net = smallNet(1);
  torch::optim::SGD opt(net->parameters(), 0.1);
  Hogwild hogwild(net.ptr(), opt, {.replicas = 3});
  const auto before = parametersOf(*net);
  double first = 0, last = 0;
  for (size_t i = 0; i < d.x.size(); ++i) {
    const double loss = hogwild.step(d.x[0], d.y[0], kLoss);  // one batch again and again: the loss falls
    if (i == 0) first = loss;
    last = loss;
  }
  EXPECT_LT(last, first);
  EXPECT_EQ(hogwild.replica(2).parameters()[0].data_ptr(), net->parameters()[0].data_ptr());
  const ReplicaStats s = hogwild.stats();
  EXPECT_EQ(s.updates, 30);
  EXPECT_GE(s.stalenessMax, 0);
  EXPECT_LE(s.stalenessMax, 2);  // at most the other two replicas' updates of the same step
  EXPECT_LE(s.conflicts, s.updates);
}

// Mirrored across processes (ranks as threads here), replicas inside each: equals one process on
// the union of every rank's batch, with the buckets' allreduces launched while backward runs
// (overlap) or after it.
class MirroredAcrossProcesses : public ::testing::TestWithParam<bool> {};

TEST_P(MirroredAcrossProcesses, EqualsOneProcessOnAllBatches) {
  const int world = 2, R = 2;
  const Data d = batches(4, 8 * world);
  std::vector<std::vector<torch::Tensor>> got(world);
  std::vector<int64_t> sent(world);
  // Built before the rank threads: two threads seeding torch's one generator at once would build
  // other nets than smallNet(10) and smallNet(11).
  std::vector<nn::Sequential> nets;
  for (int r = 0; r < world; ++r) nets.push_back(smallNet(uint64_t(10 + r)));
  test::onRanks(world, [&](std::shared_ptr<Communicator> comm) {
    const int rank = comm->rank();
    auto& net = nets[size_t(rank)];  // rank 0's is broadcast
    torch::optim::SGD opt(net->parameters(), 0.1);
    Mirrored mirrored(Job::fromCommunicator(comm), net.ptr(), opt,
                      {.replicas = R, .bucketMb = 0.0005, .overlap = GetParam()});
    for (size_t i = 0; i < d.x.size(); ++i) {
      mirrored.step(d.x[i].narrow(0, 8 * rank, 8), d.y[i].narrow(0, 8 * rank, 8), kLoss);
    }
    got[size_t(rank)] = parametersOf(*net);
    sent[size_t(rank)] = mirrored.stats().bytesSent;
  });
  EXPECT_GT(sent[0], 0);
  EXPECT_EQ(sent[0], sent[1]);
  // smallNet(10) is not smallNet(1): compare with the reference trained from rank 0's start.
  auto net = smallNet(10);
  torch::optim::SGD opt(net->parameters(), 0.1);
  for (size_t i = 0; i < d.x.size(); ++i) {
    opt.zero_grad();
    crossEntropy(*net, d.x[i], d.y[i]).backward();
    opt.step();
  }
  EXPECT_LT(maxDifference(got[0], parametersOf(*net)), 1e-5);
  EXPECT_TRUE(identical(got[0], got[1]));
}

INSTANTIATE_TEST_SUITE_P(Mirrored, MirroredAcrossProcesses, ::testing::Bool(),
                         [](const auto& info) { return info.param ? "Overlapped" : "AfterBackward"; });

// ---- dtypes, and parameters no replica used ----

// Mirrored and CentralStorage on a float64 model equal one process at float64's precision; on a
// bfloat16 model they sum in bfloat16, the replicas bit-identical and within its rounding of one
// process.
class ReplicaDtypes : public ::testing::TestWithParam<std::tuple<Scheme, torch::Dtype>> {};

TEST_P(ReplicaDtypes, EqualOneProcessInTheModelsDtype) {
  const auto [scheme, dtype] = GetParam();
  Data d = batches(3, 12);
  for (auto& x : d.x) x = x.to(dtype);
  auto alone = smallNet(1);
  alone->to(dtype);
  const auto expected = trainAlone(d, 0.1, alone);
  auto net = smallNet(1);
  net->to(dtype);
  torch::optim::SGD opt(net->parameters(), 0.1);
  auto group = makeGroup(scheme, net, opt, {.replicas = 3, .bucketMb = 0.0002});
  for (size_t i = 0; i < d.x.size(); ++i) group->step(d.x[i], d.y[i], kLoss);
  const auto got = parametersOf(*net);
  for (const auto& p : got) EXPECT_EQ(p.scalar_type(), dtype);
  const double tolerance = dtype == torch::kFloat64 ? 1e-12 : 4e-3;  // seen: 1.4e-17, 4.9e-4 (bfloat16)
  EXPECT_LT(maxDifference(got, expected), tolerance);
  for (int r = 1; r < 3; ++r) EXPECT_TRUE(identical(parametersOf(group->replica(r)), got)) << r;
  int64_t bytes = 0;  // of the model's gradients, in its dtype
  for (const auto& p : got) bytes += p.numel() * int64_t(p.element_size());
  EXPECT_EQ(group->stats().bytesReduced, int64_t(d.x.size()) * 3 * bytes);
}

INSTANTIATE_TEST_SUITE_P(Replicas, ReplicaDtypes,
                         ::testing::Values(std::make_tuple(Scheme::kMirrored, torch::kFloat64),
                                           std::make_tuple(Scheme::kCentral, torch::kFloat64),
                                           std::make_tuple(Scheme::kMirrored, torch::kBFloat16),
                                           std::make_tuple(Scheme::kCentral, torch::kBFloat16),
                                           std::make_tuple(Scheme::kMirrored, torch::kFloat16)),
                         [](const auto& info) {
                           const bool mirrored = std::get<0>(info.param) == Scheme::kMirrored;
                           const auto dtype = std::get<1>(info.param);
                           return std::string(mirrored ? "Mirrored" : "Central") + (dtype == torch::kFloat64 ? "Float64"
                                                                                    : dtype == torch::kHalf
                                                                                        ? "Float16"
                                                                                        : "Bfloat16");
                         });

// A model whose last layer is float64 and the others float32: a bucket of each (the buckets are
// large enough for the whole model), and the group equals one process.
TEST(Mirrored, MixedDtypeModelGetsABucketPerDtype) {
  const auto mixedNet = [] {
    auto base = smallNet(1);
    nn::Sequential net;
    for (size_t i = 0; i < base->size(); ++i) {
      if (i == 5) net->push_back(nn::Functional([](const torch::Tensor& h) { return h.to(torch::kFloat64); }));
      net->push_back(base->begin()[std::ptrdiff_t(i)]);
    }
    net->ptr(6)->to(torch::kFloat64);
    return net;
  };
  const Data d = batches(3, 12);
  const auto expected = trainAlone(d, 0.1, mixedNet());
  auto net = mixedNet();
  torch::optim::SGD opt(net->parameters(), 0.1);
  Mirrored mirrored(net.ptr(), opt, {.replicas = 2});
  for (size_t i = 0; i < d.x.size(); ++i) mirrored.step(d.x[i], d.y[i], kLoss);
  EXPECT_EQ(mirrored.stats().buckets, 2);
  EXPECT_EQ(net->parameters().back().scalar_type(), torch::kFloat64);
  EXPECT_LT(maxDifference(parametersOf(*net), expected), 1e-5);
  EXPECT_TRUE(identical(parametersOf(mirrored.replica(1)), parametersOf(*net)));
}

// A net whose side branch the loss function may skip: its parameters then get no gradient.
struct BranchNetImpl : nn::Cloneable<BranchNetImpl> {
  BranchNetImpl() { reset(); }
  void reset() override {
    in = register_module("in", nn::Linear(4, 6));
    side = register_module("side", nn::Linear(6, 6));
    out = register_module("out", nn::Linear(6, 3));
  }
  torch::Tensor forward(const torch::Tensor& x, bool useSide) {
    auto h = torch::relu(in->forward(x));
    if (useSide) h = h + side->forward(h);
    return out->forward(h);
  }
  nn::Linear in{nullptr}, side{nullptr}, out{nullptr};
};
TORCH_MODULE(BranchNet);

BranchNet branchNet() {
  static std::mutex generator;
  std::lock_guard<std::mutex> lock(generator);
  torch::manual_seed(4);
  return BranchNet();
}

torch::optim::SGD momentumSgd(BranchNet& net) {
  return torch::optim::SGD(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9).weight_decay(0.01));
}

// Shard j of a step takes the side branch when takes(step, j). One process, loss the shards'
// losses weighted by their sizes (equal here), gradients set to none before each step: the
// reference. *sideGrad[s]: whether the side branch had a .grad at step s.
std::vector<torch::Tensor> branchAlone(const Data& d, int shards, const std::function<bool(int, int)>& takes,
                                       std::vector<bool>* sideGrad) {
  auto net = branchNet();
  auto opt = momentumSgd(net);
  for (size_t s = 0; s < d.x.size(); ++s) {
    opt.zero_grad();
    const int64_t each = d.x[s].size(0) / shards;
    torch::Tensor loss = torch::zeros({});
    for (int j = 0; j < shards; ++j) {
      auto out = net->forward(d.x[s].narrow(0, each * j, each), takes(int(s), j));
      loss = loss + nn::functional::cross_entropy(out, d.y[s].narrow(0, each * j, each)) / shards;
    }
    loss.backward();
    sideGrad->push_back(net->side->weight.grad().defined());
    opt.step();
  }
  return parametersOf(*net);
}

Data branchData(int steps, int64_t n) {
  torch::manual_seed(98);
  Data d;
  for (int i = 0; i < steps; ++i) {
    d.x.push_back(torch::randn({n, 4}));
    d.y.push_back(torch::randint(0, 3, {n}));
  }
  return d;
}

// Step 0: every shard takes the side branch; step 1: only shard 1; later steps: none.
bool takesSide(int step, int shard) { return step == 0 || (step == 1 && shard == 1); }

// Mirrored and CentralStorage: a branch no replica takes keeps .grad none, so momentum and weight
// decay leave it alone, and the group equals one process with the gradients set to none; a branch
// one replica takes gets the sum.
class UnusedParameters : public ::testing::TestWithParam<Scheme> {};

TEST_P(UnusedParameters, KeepNoGradientAndEqualOneProcess) {
  const Data d = branchData(5, 8);
  std::vector<bool> aloneSide;
  const auto expected = branchAlone(d, 2, takesSide, &aloneSide);
  ASSERT_EQ(aloneSide, (std::vector<bool>{true, true, false, false, false}));
  auto net = branchNet();
  auto opt = momentumSgd(net);
  std::unique_ptr<ReplicaGroup> g;
  if (GetParam() == Scheme::kMirrored) {
    g = std::make_unique<Mirrored>(net.ptr(), opt, ReplicaOptions{.replicas = 2, .bucketMb = 0.0002});
  } else {
    g = std::make_unique<CentralStorage>(net.ptr(), opt, ReplicaOptions{.replicas = 2, .bucketMb = 0.0002});
  }
  for (size_t s = 0; s < d.x.size(); ++s) {
    g->step(d.x[s], d.y[s], [s](int r, nn::Module& m, const torch::Tensor& x, const torch::Tensor& y) {
      return nn::functional::cross_entropy(m.as<BranchNetImpl>()->forward(x, takesSide(int(s), r)), y);
    });
    EXPECT_EQ(net->side->weight.grad().defined(), aloneSide[s]) << "step " << s;
    EXPECT_EQ(net->side->bias.grad().defined(), aloneSide[s]) << "step " << s;
    EXPECT_TRUE(net->out->weight.grad().defined()) << "step " << s;
  }
  EXPECT_LT(maxDifference(parametersOf(*net), expected), 1e-5);
  EXPECT_TRUE(identical(parametersOf(g->replica(1)), parametersOf(*net)));
}

INSTANTIATE_TEST_SUITE_P(Replicas, UnusedParameters, ::testing::Values(Scheme::kMirrored, Scheme::kCentral),
                         [](const auto& info) { return info.param == Scheme::kMirrored ? "Mirrored" : "Central"; });

// Mirrored across processes (ranks as threads), 2 replicas each: with findUnusedParameters a
// branch no replica of any process takes keeps .grad none on every process, and the job equals
// one process; without it, the branch gets zeros and momentum moves it on.
TEST(Mirrored, FindUnusedParametersAcrossProcessesEqualsOneProcess) {
  const int world = 2, R = 2;
  const Data d = branchData(5, 8 * world);
  std::vector<bool> aloneSide;
  const auto expected = branchAlone(d, world * R, takesSide, &aloneSide);
  for (const bool find : {true, false}) {
    SCOPED_TRACE(find ? "findUnusedParameters" : "without findUnusedParameters");
    std::vector<BranchNet> nets{branchNet(), branchNet()};
    std::vector<std::vector<torch::Tensor>> got(world);
    test::onRanks(world, [&](std::shared_ptr<Communicator> comm) {
      const int rank = comm->rank();
      auto& net = nets[size_t(rank)];
      auto opt = momentumSgd(net);
      Mirrored mirrored(Job::fromCommunicator(comm), net.ptr(), opt,
                        {.replicas = R, .bucketMb = 0.0002, .findUnusedParameters = find});
      for (size_t s = 0; s < d.x.size(); ++s) {
        mirrored.step(d.x[s].narrow(0, 8 * rank, 8), d.y[s].narrow(0, 8 * rank, 8),
                      [&, s](int r, nn::Module& m, const torch::Tensor& x, const torch::Tensor& y) {
                        const bool side = takesSide(int(s), rank * R + r);
                        return nn::functional::cross_entropy(m.as<BranchNetImpl>()->forward(x, side), y);
                      });
        EXPECT_EQ(net->side->weight.grad().defined(), aloneSide[s] || !find) << "rank " << rank << " step " << s;
      }
      got[size_t(rank)] = parametersOf(*net);
    });
    EXPECT_TRUE(identical(got[0], got[1]));
    if (find) {
      EXPECT_LT(maxDifference(got[0], expected), 1e-5);
    } else {
      EXPECT_GT(maxDifference(got[0], expected), 1e-4);  // the side branch moved on
    }
  }
}

// ---- averaging's outer optimizer ----

// Two ranks, K local SGD steps on different data, then an average; returns rank 0's parameters,
// and in *start the ones it began from (after the handle's broadcast: the ranks are threads, and
// two threads seeding the global generator at once may build different nets).
std::vector<torch::Tensor> averageRun(AveragingOptions options, int rounds = 3,
                                      std::vector<torch::Tensor>* start = nullptr,
                                      torch::Dtype dtype = torch::kFloat32) {
  std::vector<torch::Tensor> out;
  Data d = batches(2 * rounds * 2, 8);
  for (auto& x : d.x) x = x.to(dtype);
  test::onRanks(2, [&](std::shared_ptr<Communicator> comm) {
    auto net = smallNet(1);
    net->to(dtype);
    torch::optim::SGD opt(net->parameters(), 0.1);
    ParameterAveraging averaging(Job::fromCommunicator(comm), *net, &opt, options);
    if (start != nullptr && comm->rank() == 0) *start = parametersOf(*net);
    for (int i = 0; i < 2 * rounds; ++i) {
      const size_t at = size_t(2 * i + comm->rank());
      opt.zero_grad();
      crossEntropy(*net, d.x[at], d.y[at]).backward();
      opt.step();
      averaging.step();
    }
    if (comm->rank() == 0) out = parametersOf(*net);
  });
  return out;
}

TEST(OuterOptimizer, SgdWithLearningRateOneIsPlainAveragingExactly) {
  const auto plain = averageRun({.period = 2});
  const auto outer = averageRun({.period = 2, .outerOptimizer = AveragingOptions::Outer::kSgd, .outerLr = 1.0});
  EXPECT_TRUE(identical(plain, outer));
  // Through the outer optimizer's own arithmetic (Nesterov without momentum, lr 1), the same up to rounding.
  const auto viaOuter =
      averageRun({.period = 2, .outerOptimizer = AveragingOptions::Outer::kNesterov, .outerLr = 1.0, .outerMomentum = 0});
  EXPECT_LT(maxDifference(plain, viaOuter), 1e-6);
}

// Nesterov on the averaged change, computed by hand from plain averaging's rounds: with period 2
// and 3 rounds, replaying plain averages gives each round's mean; the outer rule must then hold.
TEST(OuterOptimizer, NesterovAppliesTheAveragedChangeWithMomentum) {
  const double lr = 0.7, mu = 0.9;
  std::vector<torch::Tensor> start, plainStart, momentumStart;
  const auto outer = averageRun(
      {.period = 2, .outerOptimizer = AveragingOptions::Outer::kNesterov, .outerLr = lr, .outerMomentum = mu}, 1, &start);
  const auto plain = averageRun({.period = 2}, 1, &plainStart);
  ASSERT_TRUE(identical(start, plainStart));
  // One round: x1 = x0 + lr (D + mu D) with D = mean - x0 (the momentum starts at zero).
  std::vector<torch::Tensor> expected;
  for (size_t i = 0; i < start.size(); ++i) {
    const auto change = plain[i] - start[i];
    expected.push_back(start[i] + lr * (1 + mu) * change);
  }
  EXPECT_LT(maxDifference(outer, expected), 1e-5);
  EXPECT_GT(maxDifference(outer, plain), 1e-4);  // it did something
  const auto momentum = averageRun(
      {.period = 2, .outerOptimizer = AveragingOptions::Outer::kMomentum, .outerLr = lr, .outerMomentum = mu}, 1,
      &momentumStart);
  ASSERT_TRUE(identical(start, momentumStart));
  std::vector<torch::Tensor> expectedMomentum;
  for (size_t i = 0; i < start.size(); ++i) expectedMomentum.push_back(start[i] + lr * (plain[i] - start[i]));
  EXPECT_LT(maxDifference(momentum, expectedMomentum), 1e-5);
}

// Parameter averaging in the model's dtype. Period 1 with plain SGD equals one process on both
// ranks' batches (the mean of two SGD steps from one point is the step on the mean gradient): at
// float64 within its precision, at bfloat16 within its rounding. Nesterov's outer step holds in
// float64 too. A codec that compresses float32 is refused, naming codec none.
TEST(ParameterAveraging, Float64AndBfloat16ModelsAverageInTheirDtype) {
  const int rounds = 3;
  for (const auto dtype : {torch::kFloat64, torch::kBFloat16}) {
    SCOPED_TRACE(c10::toString(dtype));
    std::vector<torch::Tensor> start;
    const auto got = averageRun({.period = 1}, rounds, &start, dtype);
    Data d = batches(2 * rounds * 2, 8);
    auto alone = smallNet(1);
    alone->to(dtype);
    torch::optim::SGD opt(alone->parameters(), 0.1);
    for (int i = 0; i < 2 * rounds; ++i) {
      opt.zero_grad();
      const auto x = torch::cat({d.x[size_t(2 * i)], d.x[size_t(2 * i + 1)]}).to(dtype);
      crossEntropy(*alone, x, torch::cat({d.y[size_t(2 * i)], d.y[size_t(2 * i + 1)]})).backward();
      opt.step();
    }
    for (const auto& p : got) EXPECT_EQ(p.scalar_type(), dtype);
    // bfloat16: every average rounds again (the sum, as torch's average_parameters, in the dtype),
    // a few units of its last place over 6 averages; seen 5.9e-3.
    EXPECT_LT(maxDifference(got, parametersOf(*alone)), dtype == torch::kFloat64 ? 1e-12 : 1.2e-2);
    EXPECT_GT(maxDifference(got, start), 1e-3);  // it trained
  }
  const double lr = 0.7, mu = 0.9;
  std::vector<torch::Tensor> start, plainStart;
  const auto outer = averageRun(
      {.period = 2, .outerOptimizer = AveragingOptions::Outer::kNesterov, .outerLr = lr, .outerMomentum = mu}, 1,
      &start, torch::kFloat64);
  const auto plain = averageRun({.period = 2}, 1, &plainStart, torch::kFloat64);
  ASSERT_TRUE(identical(start, plainStart));
  std::vector<torch::Tensor> expected;
  for (size_t i = 0; i < start.size(); ++i) expected.push_back(start[i] + lr * (1 + mu) * (plain[i] - start[i]));
  EXPECT_LT(maxDifference(outer, expected), 1e-12);
  // bfloat16 with an outer optimizer: its state (the anchor, the momentum) is float32, so small
  // outer steps are not rounded away; the model stays bfloat16.
  test::onRanks(2, [&](std::shared_ptr<Communicator> comm) {
    auto model = smallNet(1);
    model->to(torch::kBFloat16);
    ParameterAveraging averaging(Job::fromCommunicator(comm), *model, nullptr,
                                 {.outerOptimizer = AveragingOptions::Outer::kNesterov, .outerLr = 0.7});
    EXPECT_EQ(averaging.outerMomentum().scalar_type(), torch::kFloat32);
    averaging.step();
    for (const auto& p : model->parameters()) EXPECT_EQ(p.scalar_type(), torch::kBFloat16);
  });
  auto net = smallNet(1);
  net->to(torch::kBFloat16);
  try {
    ParameterAveraging averaging(Job::single(), *net, nullptr, {.codec = "fp16"});
    FAIL() << "no error for a bfloat16 model under fp16";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("codec none"), std::string::npos) << e.what();
  }
}

// ---- the vertical split ----

nn::Sequential mlpNet(uint64_t seed) {
  torch::manual_seed(seed);
  return nn::Sequential(nn::Flatten(), nn::Linear(36, 7), nn::ReLU(), nn::Linear(7, 6), nn::ReLU(), nn::Linear(6, 5));
}

// The loss of `net` on (x, y), under cohort::Autocast (bfloat16) when `autocast`.
torch::Tensor lossUnder(bool autocast, nn::Module& net, const torch::Tensor& x, const torch::Tensor& y) {
  std::optional<Autocast> scope;
  if (autocast) scope.emplace(torch::kCPU);
  return crossEntropy(net, x, y);
}

// W ways (x R copies) of tensor parallelism against one process on the whole batch, plain SGD;
// with `autocast`, both under autocast in bfloat16, and the trained networks within `tolerance`.
void expectTensorEqualsOneProcess(nn::Sequential (*make)(uint64_t), int ways, int replicas, bool autocast = false,
                                  double tolerance = 1e-5) {
  const Data d = batches(5, 12);
  auto alone = make(1);
  torch::optim::SGD aloneOpt(alone->parameters(), 0.1);
  for (size_t i = 0; i < d.x.size(); ++i) {
    aloneOpt.zero_grad();
    lossUnder(autocast, *alone, d.x[i], d.y[i]).backward();
    aloneOpt.step();
  }
  const auto expected = alone->forward(d.x[0]).detach();
  std::vector<double> worst(size_t(ways * replicas), 1.0);
  std::vector<nn::Sequential> nets;  // built here, not in the threads that share torch's generator
  for (int r = 0; r < ways * replicas; ++r) nets.push_back(make(1));
  test::onRanks(ways * replicas, [&](std::shared_ptr<Communicator> comm) {
    auto net = nets[size_t(comm->rank())];
    TensorParallel tp(Job::fromCommunicator(comm), net, d.x[0], {.ways = ways});
    auto local = tp.module();
    torch::optim::SGD opt(local->parameters(), 0.1);
    std::unique_ptr<DataParallel> dp;
    if (replicas > 1) dp = std::make_unique<DataParallel>(tp.dataJob(), *local);
    const int64_t per = 12 / replicas;
    for (size_t i = 0; i < d.x.size(); ++i) {
      opt.zero_grad();
      auto x = d.x[i].narrow(0, per * tp.replica(), per);
      auto y = d.y[i].narrow(0, per * tp.replica(), per);
      lossUnder(autocast, *local, x, y).backward();
      opt.step();
    }
    // The trained split network computes what the trained whole network does.
    worst[size_t(comm->rank())] = (local->forward(d.x[0]).detach() - expected).abs().max().item<double>();
  });
  for (size_t r = 0; r < worst.size(); ++r) EXPECT_LT(worst[r], tolerance) << "rank " << r;
}

TEST(TensorParallel, ConvolutionsAndLinearsSplitEqualOneProcess) {
  expectTensorEqualsOneProcess(smallNet, 2, 1);  // 3 channels: 2 + 1
  expectTensorEqualsOneProcess(smallNet, 3, 1);
}

TEST(TensorParallel, MlpSplitUnevenlyEqualsOneProcess) {
  expectTensorEqualsOneProcess(mlpNet, 2, 1);  // 7 units: 4 + 3
  expectTensorEqualsOneProcess(mlpNet, 3, 1);  // 3 + 2 + 2
}

TEST(TensorParallel, WithDataParallelCopiesEqualsOneProcess) { expectTensorEqualsOneProcess(mlpNet, 2, 2); }

// Under autocast the ways' partial products are bfloat16 and their sums float32 (one rounding per
// way, where one process rounds the whole product once): the trained split networks stay within
// bfloat16's rounding of one process under autocast. The convolutions and linear layers both.
TEST(TensorParallel, UnderAutocastEqualsOneProcessWithinBfloat16sRounding) {
  expectTensorEqualsOneProcess(smallNet, 2, 1, /*autocast=*/true, 5e-3);
  expectTensorEqualsOneProcess(mlpNet, 3, 1, /*autocast=*/true, 5e-3);
}

TEST(TensorParallel, PlanNamesWhatWasSplit) {
  test::onRanks(2, [&](std::shared_ptr<Communicator> comm) {
    TensorParallel tp(Job::fromCommunicator(comm), mlpNet(1), torch::randn({2, 1, 6, 6}), {.ways = 2});
    EXPECT_NE(tp.plan().find("columns " + std::to_string(comm->rank() == 0 ? 4 : 3) + "/7"), std::string::npos)
        << tp.plan();
    EXPECT_NE(tp.plan().find("rows"), std::string::npos) << tp.plan();
    EXPECT_NE(tp.plan().find("5 Linear whole"), std::string::npos) << tp.plan();
  });
}

TEST(TensorParallel, RefusesMoreWaysThanALayerHasUnits) {
  test::onRanks(4, [&](std::shared_ptr<Communicator> comm) {
    try {
      TensorParallel tp(Job::fromCommunicator(comm), smallNet(1), torch::randn({2, 1, 6, 6}), {.ways = 4});
      ADD_FAILURE() << "no error";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("layer 0 ("), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("has 3 output channels, fewer than the 4 ways"), std::string::npos)
          << e.what();
    }
  });
}

// Dropout before, inside and after the split: the random draws agree where the ways hold the same
// activation, or the layers every way keeps whole would train apart.
nn::Sequential dropoutNet(uint64_t seed) {
  torch::manual_seed(seed);
  return nn::Sequential(nn::Flatten(), nn::Dropout(0.3), nn::Linear(36, 7), nn::ReLU(), nn::Dropout(0.5),
                        nn::Linear(7, 6), nn::ReLU(), nn::Dropout(0.5), nn::Linear(6, 5));
}

TEST(TensorParallel, DropoutKeepsTheWaysWholeLayersIdentical) {
  for (int ways : {2, 3}) {
    const Data d = batches(3, 12);
    std::vector<nn::Sequential> nets;
    for (int r = 0; r < ways; ++r) nets.push_back(dropoutNet(1));
    std::vector<std::vector<torch::Tensor>> last{size_t(ways)};
    std::vector<torch::Tensor> outputs{size_t(ways)};
    test::onRanks(ways, [&](std::shared_ptr<Communicator> comm) {
      TensorParallel tp(Job::fromCommunicator(comm), nets[size_t(comm->rank())], d.x[0], {.ways = ways});
      auto local = tp.module();
      torch::optim::SGD opt(local->parameters(), 0.1);
      for (size_t i = 0; i < d.x.size(); ++i) {
        opt.zero_grad();
        crossEntropy(*local, d.x[i], d.y[i]).backward();
        opt.step();
      }
      outputs[size_t(comm->rank())] = local->forward(d.x[0]).detach();
      // The last Linear, kept whole on every way.
      last[size_t(comm->rank())] = parametersOf(*local->children().back());
    });
    for (int w = 1; w < ways; ++w) {
      EXPECT_TRUE(identical(last[size_t(w)], last[0])) << ways << " ways: way " << w << "'s last layer";
      EXPECT_TRUE(torch::equal(outputs[size_t(w)], outputs[0])) << ways << " ways: way " << w << "'s output";
    }
  }
}

// A dropout on split units: each way drops its own units, drawn as the slice of one mask over all
// units (not a mask of its own shape, which the ways of one seed would draw alike); in evaluation
// nothing is dropped. The layers pass the hidden units through: the output is the mask.
TEST(TensorParallel, DropoutOnSplitUnitsDrawsEachWaysSliceOfOneMask) {
  const int64_t n = 64, units = 8;
  auto make = [&] {
    auto net =
        nn::Sequential(nn::Linear(4, units), nn::Dropout(0.5), nn::Linear(nn::LinearOptions(units, units).bias(false)));
    torch::NoGradGuard noGrad;
    net[0]->as<nn::LinearImpl>()->weight.zero_();
    net[0]->as<nn::LinearImpl>()->bias.fill_(1);
    net[2]->as<nn::LinearImpl>()->weight.copy_(torch::eye(units));
    return net;
  };
  std::vector<nn::Sequential> nets{make(), make()};
  std::vector<torch::Tensor> train(2), eval(2);
  const auto x = torch::randn({n, 4});
  test::onRanks(2, [&](std::shared_ptr<Communicator> comm) {
    const auto r = size_t(comm->rank());
    TensorParallel tp(Job::fromCommunicator(comm), nets[r], x, {.ways = 2});
    auto local = tp.module();
    train[r] = local->forward(x).detach();
    local->eval();
    eval[r] = local->forward(x).detach();
  });
  EXPECT_TRUE(torch::equal(train[0], train[1]));
  EXPECT_TRUE(torch::equal(eval[0], torch::ones({n, units})));
  EXPECT_TRUE(torch::equal(eval[1], eval[0]));
  const auto mask = train[0];
  EXPECT_TRUE(torch::equal(mask.eq(0).logical_or(mask.eq(2)), torch::ones({n, units}, torch::kBool))) << mask;
  const double dropped = mask.eq(0).to(torch::kDouble).mean().item<double>();
  EXPECT_GT(dropped, 0.35);
  EXPECT_LT(dropped, 0.65);
  // Way 0 holds units 0-3, way 1 units 4-7: their masks are not one pattern drawn twice.
  EXPECT_FALSE(torch::equal(mask.narrow(1, 0, 4), mask.narrow(1, 4, 4)));
}

// A random layer the split cannot draw alike on every way is refused, not left to train apart.
TEST(TensorParallel, RefusesARandomLayerItCannotDrawAlike) {
  test::onRanks(2, [&](std::shared_ptr<Communicator> comm) {
    torch::manual_seed(1);
    auto net = nn::Sequential(nn::Flatten(), nn::AlphaDropout(0.2), nn::Linear(36, 7), nn::ReLU(), nn::Linear(7, 5));
    try {
      TensorParallel tp(Job::fromCommunicator(comm), net, torch::randn({2, 1, 6, 6}), {.ways = 2});
      ADD_FAILURE() << "no error";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("layer 1 ("), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("draws random numbers"), std::string::npos) << e.what();
    }
  });
}

// ---- the command line ----

TEST(ReplicasCli, BadInputIsOneLineErrors) {
  struct Case {
    std::string args, expected;
  };
  const std::vector<Case> cases = {
      {"--strategy mirrored --replicas 65 --batch 64", "--replicas 65 is larger than --batch 64"},
      {"--strategy hogwild --replicas 2 --codec fp16", "--codec fp16 does not apply to --strategy hogwild"},
      {"--strategy central --replicas -2", "--replicas: Value -2 not in range 1 to"},
      {"--strategy tensor --ways 3", "--strategy tensor --ways 3 needs a multiple of 3 processes"},
      {"--strategy hogwild --replicas 2 --bucket-mb 1", "--bucket-mb does not apply to --strategy hogwild"},
      {"--strategy mirrored --replicas 2 --first-bucket-mb 1",
       "--first-bucket-mb does not apply to --strategy mirrored"},
      {"--strategy central --replicas 2 --bucket-mb 0", "--bucket-mb must be positive, got 0"},
      {"--strategy hogwild --replicas 2 --balance-shards",
       "--balance-shards applies to --strategy mirrored and central only"},
      {"--strategy allreduce --balance-shards", "--balance-shards applies to --strategy mirrored and central only"},
  };
  for (const auto& c : cases) {
    auto r = test::runCommand(test::cohortBinary() + " train --model mlp --data synthetic:64 --steps 1 --progress off " +
                              c.args);
    EXPECT_NE(r.exitCode, 0) << c.args;
    EXPECT_NE(r.output.find("cohort: error: " + c.expected), std::string::npos) << c.args << "\n" << r.output;
    EXPECT_EQ(test::lines(r.output).size(), 1u) << r.output;
  }
}

// The zoo's lstm and (dense) embed models copy into replicas: they are Cloneable, as torch's layers
// are (each failed at attach, asking to subclass nn::Cloneable). mirrored and central equal local.
TEST(ReplicasCli, TheZoosLstmAndEmbedTrainAsReplicas) {
  for (const std::string model :
       {"lstm --data synthetic:64", "embed:sparse=0,rows=1000 --data synthetic-bags:64,1000"}) {
    std::map<std::string, std::string> done;
    for (const std::string scheme : {"local", "mirrored", "central", "hogwild"}) {
      auto r =
          test::runCommand(test::cohortBinary() + " train --steps 2 --batch 8 --threads 1 --progress off --model " +
                               model + " --strategy " + scheme + (scheme == "local" ? "" : " --replicas 2"),
                           120);
      ASSERT_EQ(r.exitCode, 0) << scheme << " " << model << "\n" << r.output;
      const std::string line = test::lines(r.output).back();
      done[scheme] = line.substr(0, line.find(" samples/s"));
      done[scheme] = done[scheme].substr(0, done[scheme].rfind(','));  // up to the test loss
    }
    EXPECT_EQ(done["mirrored"], done["local"]) << model;
    EXPECT_EQ(done["central"], done["local"]) << model;
  }
  // A sparse table is refused by name (central failed inside a replica with torch's internal assert).
  auto sparse = test::runCommand(test::cohortBinary() +
                                     " train --steps 2 --batch 8 --threads 1 --progress off "
                                     "--model embed:rows=1000 --data synthetic-bags:64,1000 "
                                     "--strategy central --replicas 2",
                                 120);
  EXPECT_EQ(sparse.exitCode, 2) << sparse.output;
  EXPECT_NE(sparse.output.find("cohort: error: cohort::CentralStorage: parameter 0.bag.weight is an embedding table "
                               "with sparse gradients"),
            std::string::npos)
      << sparse.output;
}

// A checkpoint holds replica 0's optimizer, the caller's: a resumed hogwild's other replicas start
// from its state (their own momentum is lost), and the run says so rather than silently.
TEST(ReplicasCli, AResumedHogwildSaysNothingOfLostOptimizers) {
  test::TempDir dir;
  const std::string train = test::cohortBinary() +
                            " train --model mlp --data synthetic:64 --batch 8 --threads 1 --progress off "
                            "--strategy hogwild --replicas 2 --checkpoint-dir " +
                            dir.path();
  auto first = test::runCommand(train + " --optimizer momentum --steps 2", 120);
  ASSERT_EQ(first.exitCode, 0) << first.output;
  auto resumed = test::runCommand(train + " --optimizer momentum --steps 4 --resume", 120);
  ASSERT_EQ(resumed.exitCode, 0) << resumed.output;
  EXPECT_EQ(resumed.output.find("start from replica 0's optimizer state"), std::string::npos) << resumed.output;
}

// Hogwild's replicas 1..R-1 each step an optimizer of their own; a resumed run took replica 0's
// for all of them (its momentum, not theirs). The strategy's state now holds each, and a resumed
// group's replica 1 has the momentum it had.
TEST(Replicas, AResumedHogwildTakesBackEveryReplicasOptimizer) {
  torch::manual_seed(5);
  const auto momentumOf = [](torch::optim::Optimizer& opt) {
    std::vector<torch::Tensor> out;
    for (const auto& p : opt.param_groups()[0].params()) {
      const auto& state = static_cast<const torch::optim::SGDParamState&>(*opt.state().at(p.unsafeGetTensorImpl()));
      out.push_back(state.momentum_buffer().clone());
    }
    return out;
  };
  const LossFn loss = [](const torch::Tensor& out, const torch::Tensor& y) {
    return torch::nn::functional::cross_entropy(out, y);
  };
  ReplicaOptions options;
  options.replicas = 2;
  torch::nn::Sequential net(torch::nn::Linear(4, 3));
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  ReplicaStrategy before(cohort::Scheme::kHogwild, nullptr, options);
  before.attach(net, opt);
  Batch batch;
  batch.inputs = torch::randn({8, 4});
  batch.targets = torch::randint(0, 3, {8});
  for (int i = 0; i < 3; ++i) before.step(batch, loss);
  torch::serialize::OutputArchive out;
  before.saveState(out);
  std::string bytes;
  out.save_to([&](const void* data, size_t size) {
    bytes.append(static_cast<const char*>(data), size);
    return size;
  });
  // The resumed process: replica 0's model and optimizer as the Trainer restores them.
  torch::nn::Sequential net2(torch::nn::Linear(4, 3));
  {
    torch::NoGradGuard noGrad;
    for (size_t k = 0; k < net->parameters().size(); ++k) net2->parameters()[k].copy_(net->parameters()[k]);
  }
  torch::optim::SGD opt2(net2->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  const std::string saved0 = optimizerBytes(opt);
  torch::serialize::InputArchive zero;
  zero.load_from(saved0.data(), saved0.size());
  loadOptimizerKeepingOptions(opt2, zero);
  ReplicaStrategy after(cohort::Scheme::kHogwild, nullptr, options);
  after.resumeAt(3);
  after.attach(net2, opt2);
  torch::serialize::InputArchive in;
  in.load_from(bytes.data(), bytes.size());
  after.loadState(in);
  const auto want = momentumOf(before.group()->optimizer(1));
  const auto got = momentumOf(after.group()->optimizer(1));
  const auto replica0 = momentumOf(opt);
  ASSERT_EQ(want.size(), got.size());
  bool differsFromReplica0 = false;
  for (size_t k = 0; k < want.size(); ++k) {
    EXPECT_TRUE(torch::equal(want[k], got[k])) << "parameter " << k;
    differsFromReplica0 = differsFromReplica0 || !torch::equal(want[k], replica0[k]);
  }
  EXPECT_TRUE(differsFromReplica0) << "replica 1's momentum is replica 0's: the test shows nothing";
}

// --bucket-mb sizes mirrored's and central's in-memory buckets: the mlp's 2.7 MB of gradients fit
// one bucket of the default 4 MB, and with 0.01 MB every one of its 6 parameters has its own.
TEST(ReplicasCli, BucketMbSizesTheInMemoryBuckets) {
  for (const std::string scheme : {"mirrored", "central"}) {
    test::TempDir dir;
    const std::string train = test::cohortBinary() + " train --model mlp --data synthetic:64 --steps 1 --threads 1"
                              " --progress off --batch 8 --replicas 2 --strategy " + scheme;
    auto plain = test::runCommand(train + " --metrics " + dir.file("plain.jsonl"), 120);
    ASSERT_EQ(plain.exitCode, 0) << plain.output;
    EXPECT_EQ(test::lastEvent(dir.file("plain.jsonl"), "done")["buckets"], 1) << scheme;
    auto small = test::runCommand(train + " --bucket-mb 0.01 --metrics " + dir.file("small.jsonl"), 120);
    ASSERT_EQ(small.exitCode, 0) << small.output;
    EXPECT_EQ(test::lastEvent(dir.file("small.jsonl"), "done")["buckets"], 6) << scheme;
  }
}

// --balance-shards reaches the replicas: every step event of mirrored names its largest shard.
TEST(ReplicasCli, BalanceShardsReportsTheSplit) {
  test::TempDir dir;
  auto r = test::runCommand(test::cohortBinary() + " train --model mlp --data synthetic:64 --steps 3 --threads 1"
                            " --progress off --batch 8 --replicas 2 --strategy mirrored --balance-shards --metrics " +
                            dir.file("m.jsonl"), 120);
  ASSERT_EQ(r.exitCode, 0) << r.output;
  const auto step = test::lastEvent(dir.file("m.jsonl"), "step");
  ASSERT_TRUE(step.contains("replica_largest_shard")) << step.dump();
  EXPECT_GE(step["replica_largest_shard"].get<int64_t>(), 4);
  EXPECT_LE(step["replica_largest_shard"].get<int64_t>(), 7);
}

// Without --replicas, mirrored runs as many replicas as this process has cores: under cohort
// launch -n 2 on 2 cores that is OMP_NUM_THREADS=1 each, not the host's 2 (4 busy threads on 2
// cores). 3 here is neither this machine's core count (at most 2 in CI) nor 1.
TEST(ReplicasCli, TheDefaultReplicasAreTheProcesssCores) {
  test::TempDir dir;
  auto r = test::runCommand("env OMP_NUM_THREADS=3 " + test::cohortBinary() +
                                " train --model mlp --data synthetic:64 --steps 1 --progress off --batch 12"
                                " --strategy mirrored --metrics " +
                                dir.file("m.jsonl"),
                            120);
  ASSERT_EQ(r.exitCode, 0) << r.output;
  EXPECT_EQ(test::lastEvent(dir.file("m.jsonl"), "done")["replicas"], 3) << r.output;
}

}  // namespace
}  // namespace cohort::replicas_test
