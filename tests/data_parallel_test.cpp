// The library's DataParallel handle over a model that is not a Sequential (a residual network
// with a shared layer and a nested block), ranks as threads over a TCPStore on 127.0.0.1.
#include <cohort/cohort.h>

#include <ATen/record_function.h>
#include <torch/torch.h>

#include <map>
#include <optional>

#include "../examples/library/resnet.h"  // the library example's flags (Args)
#include "rank_threads.h"

namespace cohort::data_parallel_test {
namespace {

using test::onRanks;

// Nested submodule, skip connection, a layer applied twice (shared parameters), and an optional
// branch that some steps skip (parameters unused in those steps).
struct BlockImpl : torch::nn::Module {
  BlockImpl() : fc(register_module("fc", torch::nn::Linear(8, 8))) {}
  torch::Tensor forward(const torch::Tensor& x) { return x + torch::tanh(fc->forward(x)); }
  torch::nn::Linear fc;
};
TORCH_MODULE(Block);

struct NetImpl : torch::nn::Module {
  explicit NetImpl(bool batchNorm = false)
      : in(register_module("in", torch::nn::Linear(4, 8))),
        block(register_module("block", Block())),
        side(register_module("side", torch::nn::Linear(8, 8))),
        out(register_module("out", torch::nn::Linear(8, 3))) {
    if (batchNorm) bn = register_module("bn", torch::nn::BatchNorm1d(8));
  }
  torch::Tensor forward(const torch::Tensor& x, bool useSide = true) {
    auto h = torch::relu(in->forward(x));
    if (bn) h = bn->forward(h);
    h = block->forward(block->forward(h));  // the same block twice
    if (useSide) h = h + side->forward(h);
    return out->forward(h);
  }
  torch::nn::Linear in, side, out;
  Block block;
  torch::nn::BatchNorm1d bn{nullptr};
};
TORCH_MODULE(Net);

torch::Tensor lossOf(const torch::Tensor& out, const torch::Tensor& y) { return torch::nn::functional::cross_entropy(out, y); }

struct Data {
  torch::Tensor x, y;
};

// A fixed data set of n examples.
Data makeData(int64_t n) {
  torch::manual_seed(7);
  return {torch::randn({n, 4}), torch::randint(0, 3, {n}, torch::kInt64)};
}

// Rank r of w takes examples r, r+w, ... of the batch [start, start + w*b).
Data shard(const Data& d, int64_t start, int64_t b, int r, int w) {
  auto idx = torch::arange(start + r, start + int64_t(w) * b, w, torch::kInt64);
  return {d.x.index_select(0, idx), d.y.index_select(0, idx)};
}

std::vector<torch::Tensor> snapshot(torch::nn::Module& m) {
  std::vector<torch::Tensor> out;
  for (auto& p : m.parameters()) out.push_back(p.detach().clone());
  return out;
}

void expectClose(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b, double tol = 1e-5) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_TRUE(torch::allclose(a[i], b[i], tol, tol)) << "tensor " << i << " differs by "
                                                       << (a[i] - b[i]).abs().max().item<float>();
  }
}

void expectEqual(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(torch::equal(a[i], b[i])) << "tensor " << i;
}

// The initial parameters of every run, made once on the test's thread: ranks are threads that
// share torch's default generator, so seeding inside them would race.
std::vector<torch::Tensor> initialParameters() {
  torch::manual_seed(1);
  Net net;
  return snapshot(*net);
}

void load(torch::nn::Module& m, const std::vector<torch::Tensor>& values) {
  torch::NoGradGuard noGrad;
  auto params = m.parameters();
  for (size_t i = 0; i < params.size(); ++i) params[i].copy_(values[i]);
}

// The reference: one process, batch w*b, plain SGD.
std::vector<torch::Tensor> singleProcess(const Data& d, int steps, int64_t bigBatch) {
  Net net;
  load(*net, initialParameters());
  torch::optim::SGD opt(net->parameters(), 0.1);
  for (int s = 0; s < steps; ++s) {
    opt.zero_grad();
    auto part = shard(d, s * bigBatch, bigBatch, 0, 1);
    lossOf(net->forward(part.x), part.y).backward();
    opt.step();
  }
  return snapshot(*net);
}

class DataParallelEquivalence : public ::testing::TestWithParam<std::tuple<int, bool>> {};

// N ranks x batch b equal one process x batch N*b: the user's own loop, with zero_grad().
TEST_P(DataParallelEquivalence, RanksEqualOneProcessWithTheCombinedBatch) {
  const auto [world, overlap] = GetParam();
  const int64_t b = 6;
  const int steps = 4;
  const Data d = makeData(int64_t(world) * b * steps);
  const auto reference = singleProcess(d, steps, int64_t(world) * b);
  const auto init = initialParameters();
  std::vector<std::vector<torch::Tensor>> finals(static_cast<size_t>(world));
  onRanks(world, [&](std::shared_ptr<Communicator> comm) {
    const int r = comm->rank();
    Net net;  // random: the handle broadcasts rank 0's
    if (r == 0) load(*net, init);
    torch::optim::SGD opt(net->parameters(), 0.1);
    DataParallel dp(Job::fromCommunicator(comm), *net, {.bucketMb = 0.0005, .firstBucketMb = 0.0002, .overlap = overlap});
    EXPECT_GT(dp.stats().buckets, 1u);
    for (int s = 0; s < steps; ++s) {
      opt.zero_grad();
      auto part = shard(d, s * world * b, b, r, world);
      lossOf(net->forward(part.x), part.y).backward();
      opt.step();
    }
    EXPECT_EQ(dp.stats().syncSteps, steps);
    EXPECT_GT(dp.stats().bytesSent, 0);
    finals[size_t(r)] = snapshot(*net);
  });
  for (int r = 0; r < world; ++r) expectClose(finals[size_t(r)], reference);
}

INSTANTIATE_TEST_SUITE_P(WorldsAndOverlap, DataParallelEquivalence,
                         ::testing::Combine(::testing::Values(2, 3), ::testing::Bool()));

// k micro-steps, k-1 of them under noSync, equal one step on k times the batch.
TEST(DataParallel, NoSyncAccumulatesLikeOneLargerBatch) {
  const int world = 2, k = 3, steps = 2;
  const int64_t b = 4;
  const Data d = makeData(int64_t(world) * b * k * steps);
  const auto reference = singleProcess(d, steps, int64_t(world) * b * k);
  const auto init = initialParameters();
  std::vector<std::vector<torch::Tensor>> finals(world);
  onRanks(world, [&](std::shared_ptr<Communicator> comm) {
    const int r = comm->rank();
    Net net;
    load(*net, init);
    torch::optim::SGD opt(net->parameters(), 0.1);
    DataParallel dp(Job::fromCommunicator(comm), *net);
    for (int s = 0; s < steps; ++s) {
      opt.zero_grad();
      // This rank's k*b examples of the combined batch, in k micro-batches of b.
      auto mine = shard(d, int64_t(s) * world * b * k, b * k, r, world);
      for (int j = 0; j < k; ++j) {
        auto x = mine.x.narrow(0, j * b, b);
        auto y = mine.y.narrow(0, j * b, b);
        if (j < k - 1) {
          auto scope = dp.noSync();
          (lossOf(net->forward(x), y) / k).backward();
        } else {
          (lossOf(net->forward(x), y) / k).backward();
        }
      }
      opt.step();
    }
    EXPECT_EQ(dp.stats().syncSteps, steps);
    finals[size_t(r)] = snapshot(*net);
  });
  for (int r = 0; r < world; ++r) expectClose(finals[size_t(r)], reference);
}

// Different data on each rank, momentum, a branch rank 1 skips every other step, BatchNorm
// buffers and an fp16 or sparse codec: the replicas end bit-identical, buffers included.
class DataParallelReplicas : public ::testing::TestWithParam<std::string> {};

TEST_P(DataParallelReplicas, EndBitIdenticalWithMomentumUnusedParametersAndBuffers) {
  const std::string codec = GetParam();
  std::vector<std::vector<torch::Tensor>> finals(2), buffers(2);
  onRanks(2, [&](std::shared_ptr<Communicator> comm) {
    const int r = comm->rank();
    torch::manual_seed(10 + r);
    Net net(/*batchNorm=*/true);
    torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    DataParallel dp(Job::fromCommunicator(comm), *net, {.codec = codec});
    for (int s = 0; s < 6; ++s) {
      opt.zero_grad();
      auto x = torch::randn({8, 4});  // seeded per rank: different data
      auto y = torch::randint(0, 3, {8}, torch::kInt64);
      const bool useSide = !(r == 1 && s % 2 == 0);
      lossOf(net->forward(x, useSide), y).backward();
      opt.step();
    }
    finals[size_t(r)] = snapshot(*net);
    for (auto& b : net->buffers()) buffers[size_t(r)].push_back(b.clone());
  });
  expectEqual(finals[0], finals[1]);
  expectEqual(buffers[0], buffers[1]);
}

INSTANTIATE_TEST_SUITE_P(Codecs, DataParallelReplicas,
                         ::testing::Values("none", "fp16", "bf16", "topk:0.3", "threshold:0.01", "onebit"));

// findUnusedParameters: a branch no rank takes keeps no .grad, so momentum and weight decay
// leave it alone, as in one process with the combined batch (DDP's find_unused_parameters);
// without the option its .grad becomes zeros and momentum moves it on.
TEST(DataParallel, ParametersNoRankUsedKeepNoGradientWithFindUnusedParameters) {
  const int world = 2, steps = 5;
  const int64_t b = 4;
  const Data d = makeData(int64_t(world) * b * steps);
  const auto init = initialParameters();
  const auto sgd = [](Net& net) {
    return torch::optim::SGD(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9).weight_decay(0.01));
  };
  const auto useSide = [](int s) { return s < 2; };  // every rank: the side branch in the first steps only
  Net ref;
  load(*ref, init);
  auto refOpt = sgd(ref);
  for (int s = 0; s < steps; ++s) {
    refOpt.zero_grad();
    auto part = shard(d, int64_t(s) * world * b, int64_t(world) * b, 0, 1);
    lossOf(ref->forward(part.x, useSide(s)), part.y).backward();
    refOpt.step();
  }
  ASSERT_FALSE(ref->side->weight.grad().defined());
  const auto reference = snapshot(*ref);
  std::map<bool, int64_t> sent;  // by rank 0
  for (const bool find : {true, false}) {
    SCOPED_TRACE(find ? "findUnusedParameters" : "without findUnusedParameters");
    std::vector<std::vector<torch::Tensor>> finals(world);
    std::vector<torch::Tensor> sides(world);
    onRanks(world, [&](std::shared_ptr<Communicator> comm) {
      const int r = comm->rank();
      Net net;
      load(*net, init);
      auto opt = sgd(net);
      DataParallel dp(Job::fromCommunicator(comm), *net, {.bucketMb = 0.0005, .findUnusedParameters = find});
      for (int s = 0; s < steps; ++s) {
        opt.zero_grad();
        auto part = shard(d, int64_t(s) * world * b, b, r, world);
        lossOf(net->forward(part.x, useSide(s)), part.y).backward();
        EXPECT_EQ(net->side->weight.grad().defined(), useSide(s) || !find) << "step " << s;
        EXPECT_EQ(net->side->bias.grad().defined(), useSide(s) || !find) << "step " << s;
        EXPECT_TRUE(net->out->weight.grad().defined()) << "step " << s;
        opt.step();
      }
      EXPECT_EQ(dp.stats().syncSteps, steps);
      if (r == 0) sent[find] = dp.stats().bytesSent;
      finals[size_t(r)] = snapshot(*net);
      sides[size_t(r)] = net->side->weight.detach().clone();
    });
    expectEqual(finals[0], finals[1]);
    if (find) {
      expectClose(finals[0], reference);
    } else {
      // The side branch's weight went on moving.
      EXPECT_FALSE(torch::allclose(sides[0], ref->side->weight, 1e-5, 1e-5));
    }
  }
  // The option's cost, counted in stats: an int32 per parameter per step, allreduced by 2 ranks
  // (each sends 2 (w-1)/w of it).
  EXPECT_EQ(sent[true] - sent[false], int64_t(steps) * int64_t(ref->parameters().size()) * 4);
}

// With findUnusedParameters, a branch only some ranks take is averaged (zeros from the others)
// and every rank gets its .grad; one no rank takes stays without. It holds through join(): the
// ranks that have joined count as using nothing.
TEST(DataParallel, FindUnusedParametersAgreesAcrossRanksAndThroughJoin) {
  std::vector<std::vector<torch::Tensor>> finals(3), sideGrads(3);
  std::vector<DataParallelStats> stats(3);
  onRanks(3, [&](std::shared_ptr<Communicator> comm) {
    const int r = comm->rank();
    torch::manual_seed(1);
    Net net;
    torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    DataParallel dp(Job::fromCommunicator(comm), *net, {.findUnusedParameters = true});
    const int batches = 5 - r;  // 5, 4, 3: ranks 1 and 2 join early
    dp.join([&] {
      for (int s = 0; s < batches; ++s) {
        opt.zero_grad();
        // Step 0: only rank 2 takes the side branch; step 1: none; steps 2 and 3: rank 0 alone,
        // the others training (2) or rank 2 joined (3); step 4: none, ranks 1 and 2 joined (what
        // they send from their shadow steps must say "not used").
        const bool side = (s == 0 && r == 2) || ((s == 2 || s == 3) && r == 0);
        auto x = torch::full({4, 4}, 0.1 * (r + 1) + 0.01 * s);
        lossOf(net->forward(x, side), torch::full({4}, s % 3, torch::kInt64)).backward();
        const bool someRank = s != 1 && s != 4;
        EXPECT_EQ(net->side->weight.grad().defined(), someRank) << "rank " << r << " step " << s;
        if (s == 0) sideGrads[size_t(r)].push_back(net->side->weight.grad().clone());
        opt.step();
      }
    });
    finals[size_t(r)] = snapshot(*net);
    stats[size_t(r)] = dp.stats();
  });
  expectEqual(sideGrads[0], sideGrads[2]);
  expectEqual(sideGrads[1], sideGrads[2]);
  EXPECT_GT(sideGrads[0][0].abs().sum().item<float>(), 0.0f);
  expectEqual(finals[0], finals[1]);
  expectEqual(finals[0], finals[2]);
  EXPECT_EQ(stats[0].syncSteps, 5);
  EXPECT_EQ(stats[2].shadowSteps, 2);
}

// A model of any floating dtype, or of several (a bucket per dtype): rank r's final parameters
// after `steps` SGD steps on its half of each batch of 8, for r = 0, 1, and then one process's on
// the whole batches. The models are made on the test's thread (the ranks share one generator).
struct DtypeRun {
  std::vector<std::vector<torch::Tensor>> ranks;
  std::vector<torch::Tensor> oneProcess;
  size_t buckets = 0;
};

// `bucketMb` sizes every bucket (the first too): the default tiny one gives each parameter its own;
// 25 puts the model in one bucket per dtype.
DtypeRun trainInDtypes(const std::function<torch::nn::Sequential()>& make, torch::Dtype inputs, int steps = 3,
                       double bucketMb = 0.0001) {
  torch::manual_seed(5);
  const auto x = torch::randn({8 * steps, 4}).to(inputs);
  const auto y = torch::randint(0, 3, {8 * steps}, torch::kInt64);
  const auto train = [&](torch::nn::Sequential& net, int64_t from, int64_t every) {
    torch::optim::SGD opt(net->parameters(), 0.1);
    for (int s = 0; s < steps; ++s) {
      opt.zero_grad();
      const auto idx = torch::arange(8 * s + from, 8 * (s + 1), every, torch::kInt64);
      lossOf(net->forward(x.index_select(0, idx)), y.index_select(0, idx)).backward();
      opt.step();
    }
  };
  std::vector<torch::nn::Sequential> models = {make(), make()};
  DtypeRun run;
  run.ranks.resize(2);
  onRanks(2, [&](std::shared_ptr<Communicator> comm) {
    const int r = comm->rank();
    DataParallel dp(Job::fromCommunicator(comm), *models[size_t(r)], {.bucketMb = bucketMb, .firstBucketMb = bucketMb});
    train(models[size_t(r)], r, 2);
    run.ranks[size_t(r)] = snapshot(*models[size_t(r)]);
    if (r == 0) run.buckets = dp.stats().buckets;
  });
  auto one = make();
  train(one, 0, 1);
  run.oneProcess = snapshot(*one);
  return run;
}

torch::nn::Sequential smallNet(torch::Dtype dtype = torch::kFloat32) {
  torch::manual_seed(2);
  torch::nn::Sequential net(torch::nn::Linear(4, 8), torch::nn::ReLU(), torch::nn::Linear(8, 3));
  net->to(dtype);
  return net;
}

// float64 parameters: the ranks equal one process at float64's precision. A model whose first
// layer is float32 and last float64 gets buckets of each and still equals one process.
TEST(DataParallel, Float64AndMixedDtypeModelsEqualOneProcess) {
  for (const double bucketMb : {0.0001, 25.0}) {  // a bucket per parameter; all in one (8-byte slots at offsets)
    const DtypeRun f64 = trainInDtypes([] { return smallNet(torch::kFloat64); }, torch::kFloat64, 3, bucketMb);
    EXPECT_EQ(f64.buckets, bucketMb > 1 ? 1u : 4u);
    expectEqual(f64.ranks[0], f64.ranks[1]);
    expectClose(f64.ranks[0], f64.oneProcess, 1e-12);
    for (const auto& p : f64.ranks[0]) EXPECT_EQ(p.scalar_type(), torch::kFloat64);
  }

  const DtypeRun mixed = trainInDtypes(
      [] {
        torch::manual_seed(2);
        torch::nn::Sequential net(torch::nn::Linear(4, 8), torch::nn::ReLU(),
                                  torch::nn::Functional([](const torch::Tensor& h) { return h.to(torch::kFloat64); }),
                                  torch::nn::Linear(8, 3));
        net->ptr(3)->to(torch::kFloat64);
        return net;
      },
      torch::kFloat32, 3, 25.0);
  EXPECT_EQ(mixed.buckets, 2u);  // buckets large enough for the whole model: one per dtype
  expectEqual(mixed.ranks[0], mixed.ranks[1]);
  expectClose(mixed.ranks[0], mixed.oneProcess);
  EXPECT_EQ(mixed.ranks[0].front().scalar_type(), torch::kFloat32);
  EXPECT_EQ(mixed.ranks[0].back().scalar_type(), torch::kFloat64);
}

// bfloat16 parameters: the gradients are averaged in bfloat16 (the ranks stay bit-identical, and
// within bfloat16's rounding of one process); a codec that compresses float32 is refused, naming
// the fix.
TEST(DataParallel, Bfloat16ModelsAverageInBfloat16AndRefuseCompression) {
  const DtypeRun bf16 = trainInDtypes([] { return smallNet(torch::kBFloat16); }, torch::kBFloat16);
  expectEqual(bf16.ranks[0], bf16.ranks[1]);
  for (const auto& p : bf16.ranks[0]) EXPECT_EQ(p.scalar_type(), torch::kBFloat16);
  expectClose(bf16.ranks[0], bf16.oneProcess, 2e-3);  // 1.2e-4 seen
  auto net = smallNet(torch::kBFloat16);
  try {
    DataParallel dp(Job::single(), *net, {.codec = "fp16"});
    FAIL() << "no error for a bfloat16 model under fp16";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("codec none"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("BFloat16"), std::string::npos) << e.what();
  }
}

// What findUnusedParameters and the dtypes refuse, each in one line naming the fix: a codec that
// keeps a residual (a skipped parameter's share of it would be dropped), a float8 model, and a
// model converted to another dtype after the handle was made.
TEST(DataParallel, RefusesWhatItCannotAverageByName) {
  const auto expectRefused = [](const std::function<void()>& f, const std::string& phrase) {
    try {
      f();
      FAIL() << "no error; expected one saying: " << phrase;
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find(phrase), std::string::npos) << e.what();
    }
  };
  auto net = smallNet();
  expectRefused([&] { DataParallel dp(Job::single(), *net, {.codec = "topk:0.1", .findUnusedParameters = true}); },
                "use codec none, fp16 or bf16");
  auto float8 = smallNet();
  float8->to(torch::kFloat8_e4m3fn);
  expectRefused([&] { DataParallel dp(Job::single(), *float8, {}); }, "float32, float64, float16 and bfloat16");
  onRanks(2, [&](std::shared_ptr<Communicator> comm) {
    auto model = smallNet();
    DataParallel dp(Job::fromCommunicator(comm), *model);
    model->to(torch::kFloat64);
    expectRefused(
        [&] {
          lossOf(model->forward(torch::ones({2, 4}, torch::kFloat64)), torch::zeros({2}, torch::kInt64)).backward();
        },
        "before making the handle");
  });
}

// Every codec's buckets start from the gradient hooks, before backward ends (the sparse codecs
// used to wait for its end): one bucket per parameter, and a hook of the test's own on the first
// layer's weight, whose gradient comes last, sees the buckets of every later layer started. The
// exchanges run on the codec's communication thread meanwhile; the replicas still agree.
class DataParallelOverlap : public ::testing::TestWithParam<std::string> {};

TEST_P(DataParallelOverlap, EveryCodecStartsItsBucketsBeforeBackwardEnds) {
  const std::string codec = GetParam();
  const Data d = makeData(32);
  const auto init = initialParameters();
  std::vector<std::vector<torch::Tensor>> finals(2);
  onRanks(2, [&](std::shared_ptr<Communicator> comm) {
    const int r = comm->rank();
    Net net;
    load(*net, init);
    torch::optim::SGD opt(net->parameters(), 0.1);
    DataParallel dp(Job::fromCommunicator(comm), *net, {.bucketMb = 1e-6, .firstBucketMb = 1e-6, .codec = codec});
    const int64_t buckets = int64_t(dp.stats().buckets);
    EXPECT_EQ(buckets, int64_t(net->parameters().size()));
    std::vector<int64_t> startedAtFirstLayer;
    // Registered after the handle's own hook, so it runs after it for the same gradient.
    net->in->weight.register_hook([&](torch::Tensor) {
      startedAtFirstLayer.push_back(dp.stats().bucketsStartedInBackward);
    });
    const int steps = 3;
    for (int s = 0; s < steps; ++s) {
      opt.zero_grad();
      auto part = shard(d, s * 8, 4, r, 2);
      const int64_t before = dp.stats().bucketsStartedInBackward;
      lossOf(net->forward(part.x), part.y).backward();
      ASSERT_EQ(startedAtFirstLayer.size(), size_t(s + 1));
      // in.bias's bucket comes before in.weight's; autograd may run its hook after in.weight's.
      EXPECT_GE(startedAtFirstLayer.back() - before, buckets - 2) << "step " << s;
      EXPECT_EQ(dp.stats().bucketsStartedInBackward - before, buckets) << "step " << s;
      opt.step();
    }
    EXPECT_EQ(dp.stats().syncSteps, steps);
    if (codec != "none") EXPECT_GT(dp.stats().encodeSeconds + dp.stats().decodeSeconds, 0.0);
    finals[size_t(r)] = snapshot(*net);
  });
  expectEqual(finals[0], finals[1]);
}

INSTANTIATE_TEST_SUITE_P(Codecs, DataParallelOverlap,
                         ::testing::Values("none", "fp16", "bf16", "topk:0.3", "threshold:0.01", "onebit"));

// Without overlap every bucket starts at the end of backward, whatever the codec.
TEST(DataParallel, NoOverlapStartsEveryBucketAtTheEndOfBackward) {
  const Data d = makeData(8);
  const auto init = initialParameters();
  onRanks(2, [&](std::shared_ptr<Communicator> comm) {
    Net net;
    load(*net, init);
    DataParallel dp(Job::fromCommunicator(comm), *net,
                    {.bucketMb = 1e-6, .firstBucketMb = 1e-6, .overlap = false, .codec = "threshold:0.01"});
    auto part = shard(d, 0, 4, comm->rank(), 2);
    lossOf(net->forward(part.x), part.y).backward();
    EXPECT_EQ(dp.stats().syncSteps, 1);
    EXPECT_EQ(dp.stats().bucketsStartedInBackward, 0);
  });
}

// Rank 1 has fewer batches. Inside join() the run ends and the replicas agree; the shadow steps
// are counted.
TEST(DataParallel, JoinLetsRanksWithFewerBatchesFinish) {
  std::vector<std::vector<torch::Tensor>> finals(3);
  std::vector<DataParallelStats> stats(3);
  onRanks(3, [&](std::shared_ptr<Communicator> comm) {
    const int r = comm->rank();
    torch::manual_seed(1);
    Net net;
    torch::optim::SGD opt(net->parameters(), 0.1);
    DataParallel dp(Job::fromCommunicator(comm), *net);
    const int batches = 5 - 2 * r;  // 5, 3, 1
    dp.join([&] {
      for (int s = 0; s < batches; ++s) {
        opt.zero_grad();
        lossOf(net->forward(torch::randn({4, 4})), torch::randint(0, 3, {4}, torch::kInt64)).backward();
        opt.step();
      }
    });
    finals[size_t(r)] = snapshot(*net);
    stats[size_t(r)] = dp.stats();
  });
  expectEqual(finals[0], finals[1]);
  expectEqual(finals[0], finals[2]);
  EXPECT_EQ(stats[0].syncSteps, 5);
  EXPECT_EQ(stats[0].shadowSteps, 0);
  EXPECT_EQ(stats[1].syncSteps, 3);
  EXPECT_EQ(stats[1].shadowSteps, 2);
  EXPECT_EQ(stats[2].syncSteps, 1);
  EXPECT_EQ(stats[2].shadowSteps, 4);
}

// A backward that fails part-way (after some buckets went out) leaves this rank's collectives out
// of step with the others': the handle refuses to go on, naming why, instead of pairing them
// wrongly; the other rank's step fails rather than hangs.
TEST(DataParallel, ABackwardThatFailsPartWayMakesTheHandleRefuseToGoOn) {
  std::vector<std::string> errors(2);
  const auto start = std::chrono::steady_clock::now();
  onRanks(
      2,
      [&](std::shared_ptr<Communicator> comm) {
        const int r = comm->rank();
        Net net;
        DataParallel dp(Job::fromCommunicator(comm), *net, {.bucketMb = 0.0005, .firstBucketMb = 0.0002});
        auto x = torch::randn({4, 4});
        auto y = torch::zeros({4}, torch::kInt64);
        try {
          auto h = torch::relu(net->in->forward(x));
          if (r == 0) h.register_hook([](torch::Tensor) -> torch::Tensor { throw std::runtime_error("boom"); });
          auto out = net->out->forward(net->side->forward(net->block->forward(h)));
          lossOf(out, y).backward();
        } catch (const std::exception& e) {
          errors[size_t(r)] = e.what();
        }
        if (r == 0) {
          try {
            lossOf(net->forward(x), y).backward();
            errors[0] = "the second backward was let through";
          } catch (const CommError& e) {
            errors[0] = e.what();
          }
        }
      },
      std::chrono::seconds(5));
  EXPECT_NE(errors[0].find("failed part-way"), std::string::npos) << errors[0];
  EXPECT_FALSE(errors[1].empty()) << "rank 1's step went through although rank 0 never sent its buckets";
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 20.0);
}

// ParameterAveraging with averageOptimizerState: a parameter only rank 0 trains (rank 1 keeps no
// momentum for it) keeps rank 0's own momentum, where it was averaged with a zero placeholder and
// halved on rank 0 alone; the parameters both train end with the same, averaged, momentum.
TEST(ParameterAveraging, OptimizerStateOnlySomeRanksHaveIsLeftAlone) {
  const Data d = makeData(8);
  const auto init = initialParameters();
  std::vector<torch::Tensor> sideMomentum(2), outMomentum(2), ownSide(2);
  onRanks(2, [&](std::shared_ptr<Communicator> comm) {
    const int r = comm->rank();
    Net net;
    load(*net, init);
    torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    ParameterAveraging avg(Job::fromCommunicator(comm), *net, &sgd, {.period = 1, .averageOptimizerState = true});
    sgd.zero_grad();
    auto part = shard(d, 0, 4, r, 2);
    lossOf(net->forward(part.x, /*useSide=*/r == 0), part.y).backward();
    if (r == 0) ownSide[0] = net->side->weight.grad().clone();  // the first step's momentum is the gradient
    sgd.step();
    avg.step();
    auto momentumOf = [&](const torch::Tensor& p) -> torch::Tensor {
      auto it = sgd.state().find(p.unsafeGetTensorImpl());
      if (it == sgd.state().end()) return {};
      return static_cast<torch::optim::SGDParamState&>(*it->second).momentum_buffer().clone();
    };
    sideMomentum[size_t(r)] = momentumOf(net->side->weight);
    outMomentum[size_t(r)] = momentumOf(net->out->weight);
  });
  ASSERT_TRUE(sideMomentum[0].defined());
  EXPECT_FALSE(sideMomentum[1].defined());
  EXPECT_TRUE(torch::equal(sideMomentum[0], ownSide[0])) << "rank 0's own momentum was changed";
  ASSERT_TRUE(outMomentum[0].defined() && outMomentum[1].defined());
  EXPECT_TRUE(torch::equal(outMomentum[0], outMomentum[1]));
}

// A custom Function that gives one of its inputs, a parameter, no gradient (an undefined tensor):
// a straight-through trick, say.
struct NoGradientFor : torch::autograd::Function<NoGradientFor> {
  static torch::Tensor forward(torch::autograd::AutogradContext*, const torch::Tensor& x, const torch::Tensor& w) {
    return x * w;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*,
                                                 const torch::autograd::variable_list& g) {
    return {g[0], torch::Tensor()};
  }
};

struct GatedNet : torch::nn::Module {
  GatedNet() {
    lin = register_module("lin", torch::nn::Linear(4, 4));
    gate = register_parameter("gate", torch::ones({4}));
  }
  torch::Tensor forward(const torch::Tensor& x) { return NoGradientFor::apply(lin->forward(x), gate); }
  torch::nn::Linear lin{nullptr};
  torch::Tensor gate;
};

// The parameter is treated as one no rank used (before, its undefined gradient failed the dtype
// check, "a nullptr (uninitialized) gradient", and the handle refused every later step).
TEST(DataParallel, AParameterAFunctionGivesNoGradientIsAnUnusedOne) {
  for (const bool find : {false, true}) {
    SCOPED_TRACE(find ? "findUnusedParameters" : "without findUnusedParameters");
    onRanks(2, [&](std::shared_ptr<Communicator> comm) {
      GatedNet net;  // on the stack: the handle needs no shared_ptr
      DataParallel dp(Job::fromCommunicator(comm), net, {.findUnusedParameters = find});
      const auto x = torch::randn({8, 4});
      for (int step = 0; step < 2; ++step) {
        for (auto& p : net.parameters()) p.mutable_grad().reset();
        net.forward(x).sum().backward();
        EXPECT_EQ(net.gate.grad().defined(), !find) << "step " << step;
        if (!find) EXPECT_EQ(net.gate.grad().abs().sum().item<float>(), 0.0f) << "step " << step;
        EXPECT_TRUE(net.lin->weight.grad().defined()) << "step " << step;
      }
      EXPECT_EQ(dp.stats().syncSteps, 2);
    });
  }
}

// Reentrant checkpointing: the last layer recomputed, and its gradients made, by a backward nested
// in the step's. Its gradients come first, so the nested backward began the synchronization and,
// ending, ended it (the other buckets went as zeros) before the outer one began another.
struct Recomputed : torch::autograd::Function<Recomputed> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x,
                               torch::nn::Linear* layer) {
    ctx->saved_data["layer"] = reinterpret_cast<int64_t>(layer);
    ctx->save_for_backward({x});
    torch::NoGradGuard noGrad;
    return (*layer)->forward(x);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 const torch::autograd::variable_list& g) {
    auto* layer = reinterpret_cast<torch::nn::Linear*>(ctx->saved_data["layer"].toInt());
    auto x = ctx->get_saved_variables()[0].detach().requires_grad_(true);
    torch::AutoGradMode on(true);
    torch::autograd::backward({(*layer)->forward(x)}, {g[0]});
    return {x.grad(), torch::Tensor()};
  }
};

struct CheckpointedNet : torch::nn::Module {
  CheckpointedNet() {
    first = register_module("first", torch::nn::Linear(4, 4));
    last = register_module("last", torch::nn::Linear(4, 2));
  }
  torch::Tensor forward(const torch::Tensor& x) { return Recomputed::apply(first->forward(x), &last); }
  torch::nn::Linear first{nullptr}, last{nullptr};
};

TEST(DataParallel, ABackwardNestedInTheStepsIsRefusedByName) {
  std::vector<std::string> errors(2);
  onRanks(2, [&](std::shared_ptr<Communicator> comm) {
    CheckpointedNet net;
    DataParallel dp(Job::fromCommunicator(comm), net, {.firstBucketMb = 1e-6});
    try {
      net.forward(torch::ones({8, 4})).sum().backward();
      errors[size_t(comm->rank())] = "(no error)";
    } catch (const InvalidArgument& e) {
      errors[size_t(comm->rank())] = e.what();
    }
    EXPECT_EQ(dp.stats().syncSteps, 1) << "the nested backward's synchronization only";
  });
  for (const auto& e : errors) EXPECT_NE(e.find("a backward nested in another"), std::string::npos) << e;
}

// Without join(), a rank that stops early makes the others' backward fail with the documented
// error, naming the remedy, well within the timeout.
TEST(DataParallel, UnevenInputsWithoutJoinFailWithAClearError) {
  std::string error;
  const auto start = std::chrono::steady_clock::now();
  EXPECT_THROW(onRanks(
                   2,
                   [&](std::shared_ptr<Communicator> comm) {
                     const int r = comm->rank();
                     torch::manual_seed(1);
                     Net net;
                     torch::optim::SGD opt(net->parameters(), 0.1);
                     DataParallel dp(Job::fromCommunicator(comm), *net);
                     const int batches = r == 0 ? 4 : 1;
                     for (int s = 0; s < batches; ++s) {
                       opt.zero_grad();
                       try {
                         lossOf(net->forward(torch::randn({4, 4})), torch::randint(0, 3, {4}, torch::kInt64)).backward();
                       } catch (const CommError& e) {
                         error = e.what();
                         throw;
                       }
                       opt.step();
                     }
                   },
                   std::chrono::seconds(5)),
               CommError);
  EXPECT_NE(error.find("DataParallel::join()"), std::string::npos) << error;
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 20.0);
}

// The gradients are views of the buckets (DDP's gradient_as_bucket_view): from the first
// synchronized step on, each .grad is its bucket slot, and during backward a parameter whose
// gradient has come is already its slot again, whether the optimizer zeroed .grad in place or set it
// to none, so that no second copy of the gradients lives through backward. Seen from a hook on
// the first layer's weight, whose gradient autograd computes after the last layer's are added.
TEST(DataParallel, GradientsAreTheBucketSlotsThroughBackward) {
  onRanks(2, [&](std::shared_ptr<Communicator> comm) {
    torch::manual_seed(1);
    torch::nn::Sequential net(torch::nn::Linear(4, 8), torch::nn::ReLU(), torch::nn::Linear(8, 3));
    torch::optim::SGD opt(net->parameters(), 0.1);
    DataParallel dp(Job::fromCommunicator(comm), *net);
    auto x = torch::full({4, 4}, 0.5f + float(comm->rank()));
    auto y = torch::zeros({4}, torch::kInt64);
    lossOf(net->forward(x), y).backward();
    opt.step();
    const auto params = net->parameters();  // weight 0, bias 0, weight 2, bias 2
    std::vector<void*> slots;
    for (const auto& p : params) slots.push_back(p.grad().data_ptr());
    for (bool toNone : {true, false}) {
      std::vector<void*> seen;
      const unsigned hook = params[0].register_hook([&](const torch::Tensor&) {
        for (size_t k = 2; k < 4; ++k)
          seen.push_back(params[k].grad().defined() ? params[k].grad().data_ptr() : nullptr);
      });
      opt.zero_grad(toNone);
      lossOf(net->forward(x), y).backward();
      params[0].remove_hook(hook);
      ASSERT_EQ(seen.size(), 2u);
      EXPECT_EQ(seen[0], slots[2]) << "last layer's weight during backward, zero_grad(" << toNone << ")";
      EXPECT_EQ(seen[1], slots[3]) << "last layer's bias during backward, zero_grad(" << toNone << ")";
      for (size_t k = 0; k < params.size(); ++k) EXPECT_EQ(params[k].grad().data_ptr(), slots[k]) << k;
      opt.step();
    }
    // ...and they are the averaged gradients: the replicas are still the same.
    auto gathered = comm->allgather(torch::cat({params[0].flatten(), params[2].flatten()}));
    EXPECT_TRUE(torch::equal(gathered[0], gathered[1]));
  });
}

// A channels_last convolution's weight keeps its layout through the buckets (DDP's bucket views
// take their parameter's strides): .grad is laid out as its parameter, as autograd's layout
// contract asks (a contiguous slot made libtorch warn and the optimizer mix layouts), whether the
// optimizer zeroes .grad in place or sets it to none, and the ranks still equal one process with
// the combined batch.
torch::nn::Sequential convNet() {
  torch::manual_seed(1);
  return torch::nn::Sequential(torch::nn::Conv2d(torch::nn::Conv2dOptions(3, 4, 3)), torch::nn::ReLU(),
                               torch::nn::Flatten(), torch::nn::Linear(4 * 4 * 4, 3));
}

void toChannelsLast(torch::nn::Module& m) {
  torch::NoGradGuard noGrad;
  for (auto& p : m.parameters()) {
    if (p.dim() == 4) p.set_data(p.data().contiguous(torch::MemoryFormat::ChannelsLast));
  }
}

TEST(DataParallel, ChannelsLastParametersKeepTheirLayoutInTheBuckets) {
  torch::manual_seed(7);
  const auto x = torch::randn({8, 3, 6, 6});
  const auto y = torch::randint(0, 3, {8}, torch::kInt64);
  constexpr int kSteps = 4;
  auto reference = convNet();
  // The ranks start from these: their threads share torch's generator, so convNet()'s seeding
  // there races and rank 0's own draws could differ from the reference's.
  const auto init = snapshot(*reference);
  {
    torch::optim::SGD opt(reference->parameters(), 0.1);
    for (int s = 0; s < kSteps; ++s) {
      opt.zero_grad();
      lossOf(reference->forward(x), y).backward();
      opt.step();
    }
  }
  std::vector<std::vector<torch::Tensor>> ends(2);
  onRanks(2, [&](std::shared_ptr<Communicator> comm) {
    const int r = comm->rank();
    auto net = convNet();
    load(*net, init);
    toChannelsLast(*net);
    const torch::Tensor weight = net->parameters()[0];
    ASSERT_TRUE(weight.is_contiguous(torch::MemoryFormat::ChannelsLast));
    ASSERT_FALSE(weight.is_contiguous());
    torch::optim::SGD opt(net->parameters(), 0.1);
    DataParallel dp(Job::fromCommunicator(comm), *net);
    const auto mine = torch::arange(4 * r, 4 * r + 4);
    void* slot = nullptr;
    for (int s = 0; s < kSteps; ++s) {
      opt.zero_grad(/*set_to_none=*/s % 2 == 0);
      lossOf(net->forward(x.index_select(0, mine)), y.index_select(0, mine)).backward();
      EXPECT_EQ(weight.grad().strides(), weight.strides()) << "step " << s;
      if (s == 0) slot = weight.grad().data_ptr();
      EXPECT_EQ(weight.grad().data_ptr(), slot) << "step " << s << ": .grad is no longer its bucket slot";
      opt.step();
    }
    ends[size_t(r)] = snapshot(*net);
  });
  expectEqual(ends[0], ends[1]);
  expectClose(ends[0], snapshot(*reference));
}

// Ranks whose parameters are laid out differently would add unlike elements of their buckets:
// refused on every rank, naming the strides.
TEST(DataParallel, RanksWhoseLayoutsDifferAreRefused) {
  std::vector<std::string> errors(2);
  onRanks(2, [&](std::shared_ptr<Communicator> comm) {
    const int r = comm->rank();
    auto net = convNet();
    if (r == 0) toChannelsLast(*net);
    try {
      DataParallel dp(Job::fromCommunicator(comm), *net);
    } catch (const InvalidArgument& e) {
      errors[size_t(r)] = e.what();
    }
  });
  for (const auto& e : errors) EXPECT_NE(e.find("0.weight strides [27, 1, 9, 3]"), std::string::npos) << e;
}

// The operators this thread dispatches (RecordFunction, as the profiler counts them) while alive.
class OperatorCount {
 public:
  OperatorCount()
      : handle_(at::addThreadLocalCallback(
            at::RecordFunctionCallback([](const at::RecordFunction&) -> std::unique_ptr<at::ObserverContext> {
              ++count_;
              return nullptr;
            }).scopes({at::RecordScope::FUNCTION}))) {
    count_ = 0;
  }
  ~OperatorCount() { at::removeCallback(handle_); }
  int64_t count() const { return count_; }

 private:
  static thread_local int64_t count_;
  at::CallbackHandle handle_;
};
thread_local int64_t OperatorCount::count_ = 0;

// What DataParallel adds to a step is host time on a GPU, where most operators are a kernel launch
// and a small model's step is short enough for the host to limit it. At one rank, with the
// gradients set to none before backward as the command line does, it adds one copy per parameter
// (into its bucket slot) and a few operators per step, against the plain loop: a gradient that went
// through mul_out with a Scalar (a multiplication into a temporary, then a copy: 8 operators)
// fails this.
TEST(DataParallel, AStepAtOneRankAddsAboutOneOperatorPerParameter) {
  constexpr int kSteps = 3;
  const Data d = makeData(16);
  auto stepsCost = [&](Net& net, torch::optim::Optimizer& opt) {
    auto once = [&] {
      for (auto& p : net->parameters()) p.mutable_grad().reset();
      lossOf(net->forward(d.x), d.y).backward();
      opt.step();
    };
    once();  // the first step makes the momentum buffers and the slots
    OperatorCount ops;
    for (int s = 0; s < kSteps; ++s) once();
    return ops.count();
  };
  torch::manual_seed(1);
  Net plain;
  torch::optim::SGD plainOpt(plain->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  const int64_t alone = stepsCost(plain, plainOpt);
  const int64_t params = int64_t(plain->parameters().size());
  onRanks(1, [&](std::shared_ptr<Communicator> comm) {
    torch::manual_seed(1);
    Net net;
    torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    DataParallel dp(Job::fromCommunicator(comm), *net);
    const int64_t synchronized = stepsCost(net, opt);
    EXPECT_GT(synchronized, alone);
    EXPECT_LE(synchronized - alone, kSteps * (params + 6))
        << "per step: " << double(synchronized - alone) / kSteps << " operators more than the plain loop's "
        << double(alone) / kSteps << ", for " << params << " parameters";
  });
}

// Changing a parameter's dtype or device (set_data) makes autograd replace its gradient
// accumulator, where DataParallel's hook is: the handle hooks the new one, and the ranks still
// average (a dtype there and back stands in for a checkpoint loaded onto the CPU and moved back).
TEST(DataParallel, ParametersWhoseDataWasReplacedStaySynchronized) {
  onRanks(2, [&](std::shared_ptr<Communicator> comm) {
    torch::manual_seed(1);
    Net net;
    DataParallel dp(Job::fromCommunicator(comm), *net);
    {
      torch::NoGradGuard noGrad;
      for (auto& p : net->parameters()) {
        p.set_data(p.data().to(torch::kFloat64));
        p.set_data(p.data().to(torch::kFloat32));
      }
    }
    auto x = torch::full({4, 4}, 0.5f + float(comm->rank()));
    auto y = torch::zeros({4}, torch::kInt64);
    lossOf(net->forward(x), y).backward();
    EXPECT_EQ(dp.stats().syncSteps, 1);
    std::vector<torch::Tensor> grads;
    for (const auto& p : net->parameters()) grads.push_back(p.grad().flatten());
    auto gathered = comm->allgather(torch::cat(grads));
    EXPECT_TRUE(torch::equal(gathered[0], gathered[1])) << "the ranks' gradients were not averaged";
  });
}

// Destroying the handle removes its hooks: the model then trains alone, with its local gradient.
TEST(DataParallel, DestroyedHandleLeavesAModelThatTrainsAlone) {
  onRanks(2, [&](std::shared_ptr<Communicator> comm) {
    const int r = comm->rank();
    torch::manual_seed(1);
    Net net;
    torch::optim::SGD opt(net->parameters(), 0.1);
    auto x = torch::full({4, 4}, 0.5f + float(r));
    auto y = torch::zeros({4}, torch::kInt64);
    {
      DataParallel dp(Job::fromCommunicator(comm), *net);
      for (int s = 0; s < 2; ++s) {
        opt.zero_grad();
        lossOf(net->forward(x), y).backward();
        opt.step();
      }
    }
    for (int s = 0; s < 2; ++s) {
      opt.zero_grad();
      lossOf(net->forward(x), y).backward();
      // The gradient is this rank's own: recompute it on a copy and compare.
      Net copy;
      {
        torch::NoGradGuard g;
        auto src = net->parameters();
        auto dst = copy->parameters();
        for (size_t i = 0; i < src.size(); ++i) dst[i].copy_(src[i]);
      }
      lossOf(copy->forward(x), y).backward();
      auto mine = net->parameters();
      auto ref = copy->parameters();
      for (size_t i = 0; i < mine.size(); ++i) EXPECT_TRUE(torch::allclose(mine[i].grad(), ref[i].grad())) << i;
      opt.step();
    }
  });
}

TEST(DataParallel, SingleProcessJobChangesNothing) {
  torch::manual_seed(1);
  Net net;
  DataParallel dp(Job::single(), *net);
  auto x = torch::randn({4, 4});
  auto y = torch::zeros({4}, torch::kInt64);
  lossOf(net->forward(x), y).backward();
  EXPECT_EQ(dp.stats().syncSteps, 0);
  EXPECT_EQ(dp.worldSize(), 1);
  for (auto& p : net->parameters()) EXPECT_TRUE(p.grad().defined());
}

TEST(DataParallel, RefusesBadInputWithClearErrors) {
  struct Empty : torch::nn::Module {};
  Empty empty;
  try {
    DataParallel dp(Job::single(), empty);
    FAIL() << "no error for a module without parameters";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("no parameters"), std::string::npos) << e.what();
  }
  Net net;
  try {
    DataParallel dp(Job::single(), *net, {.codec = "zip"});
    FAIL() << "no error for an unknown codec";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("fp16"), std::string::npos) << e.what();
  }
  DataParallel dp(Job::single(), *net);
  try {
    dp.join([&] { dp.join([] {}); });
    FAIL() << "no error for join inside join";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("join"), std::string::npos) << e.what();
  }
}

// Models that differ across ranks are refused on every rank, naming the first difference.
TEST(DataParallel, DifferentModelsAcrossRanksAreNamed) {
  std::vector<std::string> errors(2);
  onRanks(2, [&](std::shared_ptr<Communicator> comm) {
    const int r = comm->rank();
    torch::nn::Sequential net(torch::nn::Linear(4, 8), torch::nn::Linear(8, r == 0 ? 3 : 5));
    try {
      DataParallel dp(Job::fromCommunicator(comm), *net);
    } catch (const InvalidArgument& e) {
      errors[size_t(r)] = e.what();
    }
  });
  for (const auto& e : errors) {
    EXPECT_NE(e.find("rank 1 has parameter 1.weight"), std::string::npos) << e;
    EXPECT_NE(e.find("[5, 8]"), std::string::npos) << e;
  }
}

// A second handle on a model would hook every parameter again, and each would scale the gradient
// by 1/N: the average halved, silently. It is refused, naming the parameter and the fix; once the
// first handle is gone, a new one averages as it should.
TEST(DataParallel, ASecondHandleOnOneModelIsRefused) {
  onRanks(2, [&](std::shared_ptr<Communicator> comm) {
    const int r = comm->rank();
    torch::manual_seed(1);
    Net net;
    auto x = torch::full({4, 4}, 0.5f + float(r));
    auto y = torch::zeros({4}, torch::kInt64);
    {
      DataParallel first(Job::fromCommunicator(comm), *net);
      try {
        DataParallel second(Job::fromCommunicator(comm), *net);
        ADD_FAILURE() << "no error for a second handle on one model";
      } catch (const InvalidArgument& e) {
        EXPECT_NE(std::string(e.what()).find("parameter in.weight is already hooked"), std::string::npos) << e.what();
        EXPECT_NE(std::string(e.what()).find("destroy the first handle before making another"), std::string::npos)
            << e.what();
      }
      // A module that holds the first one's parameters (a submodule) is the same model.
      try {
        DataParallel second(Job::fromCommunicator(comm), *net->out);
        ADD_FAILURE() << "no error for a handle on a submodule of a hooked model";
      } catch (const InvalidArgument& e) {
        EXPECT_NE(std::string(e.what()).find("parameter weight is already hooked"), std::string::npos) << e.what();
      }
      lossOf(net->forward(x), y).backward();  // the first handle alone: the average
    }
    std::vector<torch::Tensor> averaged;
    for (const auto& p : net->parameters()) averaged.push_back(p.grad().clone());
    net->zero_grad();
    DataParallel again(Job::fromCommunicator(comm), *net);  // the first is gone
    lossOf(net->forward(x), y).backward();
    const auto params = net->parameters();
    for (size_t i = 0; i < params.size(); ++i) EXPECT_TRUE(torch::allclose(params[i].grad(), averaged[i])) << i;
    EXPECT_EQ(again.stats().syncSteps, 1);
  });
}

// A module whose parameter w can be replaced by another tensor under the same name (b stays, and
// its hook notices).
struct Swappable : torch::nn::Module {
  Swappable() {
    w = register_parameter("w", torch::ones({3, 4}));
    b = register_parameter("b", torch::zeros({3}));
  }
  torch::Tensor forward(const torch::Tensor& x) { return torch::matmul(x, w.t()) + b; }
  void replace() {
    w = torch::full({3, 4}, 2.0f).requires_grad_();
    parameters_["w"] = w;
  }
  torch::Tensor w, b;
};

// The model changed after the handle was made is refused at the next synchronized backward, naming
// the parameter, before any exchange (so the handle takes the step once the model is back): a
// layer frozen since would get a .grad of zeros, which weight decay and momentum act on; one
// unfrozen or registered since has no hook, and the replicas would drift apart.
TEST(DataParallel, AModelChangedAfterTheHandleIsRefusedAtItsNextBackward) {
  const auto refusal = [](const std::function<void()>& f) -> std::string {
    try {
      f();
    } catch (const InvalidArgument& e) {
      return e.what();
    }
    return "(no error)";
  };
  const auto expectHas = [](const std::string& error, const std::string& phrase) {
    EXPECT_NE(error.find(phrase), std::string::npos) << error;
  };
  onRanks(2, [&](std::shared_ptr<Communicator> comm) {
    const int r = comm->rank();
    auto x = torch::full({4, 4}, 0.5f + float(r));
    auto y = torch::zeros({4}, torch::kInt64);
    {  // frozen after: no .grad, no step moves it
      torch::manual_seed(1);
      Net net;
      torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9).weight_decay(0.5));
      DataParallel dp(Job::fromCommunicator(comm), *net);
      for (auto& p : net->side->parameters()) p.set_requires_grad(false);
      const torch::Tensor before = net->side->weight.detach().clone();
      opt.zero_grad();
      const std::string error = refusal([&] { lossOf(net->forward(x), y).backward(); });
      expectHas(error, "parameter side.weight was frozen after the DataParallel handle was made");
      expectHas(error, "make the handle after changing the model");
      EXPECT_FALSE(net->side->weight.grad().defined());
      opt.step();
      EXPECT_TRUE(torch::equal(net->side->weight, before));
      // The refusal came before any exchange: with the layer trainable again the handle goes on.
      for (auto& p : net->side->parameters()) p.set_requires_grad(true);
      opt.zero_grad();
      lossOf(net->forward(x), y).backward();
      EXPECT_EQ(dp.stats().syncSteps, 1);
    }
    {  // unfrozen after
      torch::manual_seed(1);
      Net net;
      for (auto& p : net->side->parameters()) p.set_requires_grad(false);
      DataParallel dp(Job::fromCommunicator(comm), *net);
      for (auto& p : net->side->parameters()) p.set_requires_grad(true);
      const std::string error = refusal([&] { lossOf(net->forward(x), y).backward(); });
      expectHas(error, "parameter side.");
      expectHas(error, "was added or unfrozen after the DataParallel handle was made");
    }
    {  // a module registered after
      torch::manual_seed(1);
      Net net;
      DataParallel dp(Job::fromCommunicator(comm), *net);
      auto extra = net->register_module("extra", torch::nn::Linear(4, 4));
      const std::string error = refusal([&] { lossOf(net->forward(extra->forward(x)), y).backward(); });
      expectHas(error, "parameter extra.");
      expectHas(error, "was added or unfrozen after the DataParallel handle was made");
    }
    {  // a parameter replaced after
      Swappable net;
      DataParallel dp(Job::fromCommunicator(comm), net);
      net.replace();
      const std::string error = refusal([&] { net.forward(x).sum().backward(); });
      expectHas(error, "parameter w was added or unfrozen after");
    }
  });
}

// A noSync() guard that outlives its handle ends without touching it (it held a pointer into the
// handle; tests/data_parallel_asan.cpp sees the use after free that was), and a later handle on
// the model synchronizes.
TEST(DataParallel, ANoSyncGuardMayOutliveItsHandle) {
  onRanks(2, [&](std::shared_ptr<Communicator> comm) {
    torch::manual_seed(1);
    Net net;
    std::optional<DataParallel::NoSync> guard;
    {
      DataParallel dp(Job::fromCommunicator(comm), *net);
      guard.emplace(dp.noSync());
      DataParallel::NoSync moved(std::move(*guard));  // a moved-from guard undoes nothing
    }
    {
      DataParallel dp(Job::fromCommunicator(comm), *net);
      guard.emplace(dp.noSync());
    }
    guard.reset();
    DataParallel dp(Job::fromCommunicator(comm), *net);
    lossOf(net->forward(torch::full({4, 4}, 0.5f + float(comm->rank()))), torch::zeros({4}, torch::kInt64)).backward();
    EXPECT_EQ(dp.stats().syncSteps, 1);
  });
}

// examples/library's flags (resnet.h's Args): a flag without a value is an error naming it (a
// trailing one was ignored, so `./resnet_ddp --help` trained a whole epoch), and --help prints the
// flags and exits 0.
TEST(LibraryExample, AFlagWithoutAValueIsAnErrorAndHelpExits) {
  const auto parse = [](std::vector<std::string> words) {
    std::vector<char*> argv;
    for (auto& w : words) argv.push_back(w.data());
    return ::Args(int(argv.size()), argv.data());
  };
  const auto error = [&](const std::vector<std::string>& words) -> std::string {
    try {
      parse(words);
    } catch (const std::invalid_argument& e) {
      return e.what();
    }
    return "(no error)";
  };
  EXPECT_NE(error({"resnet_ddp", "--steps", "3", "--epochs"}).find("flag --epochs needs a value"), std::string::npos)
      << error({"resnet_ddp", "--steps", "3", "--epochs"});
  EXPECT_NE(error({"resnet_ddp", "--bogus", "1"}).find("unknown flag --bogus"), std::string::npos);
  EXPECT_NE(error({"resnet_ddp", "--steps", "x"}).find("flag --steps: 'x' is not a number"), std::string::npos);
  const ::Args args = parse({"resnet_ddp", "--steps", "3", "--codec", "fp16"});
  EXPECT_EQ(args.steps, 3);
  EXPECT_EQ(args.codec, "fp16");
  GTEST_FLAG_SET(death_test_style, "threadsafe");  // the ranks' tests have started threads
  EXPECT_EXIT(parse({"resnet_ddp", "--help"}), ::testing::ExitedWithCode(0), "");
  EXPECT_EXIT(parse({"resnet_ddp", "--steps", "3", "--help"}), ::testing::ExitedWithCode(0), "");
}

}  // namespace
}  // namespace cohort::data_parallel_test
