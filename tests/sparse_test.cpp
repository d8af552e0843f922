// Sparse models: the embed model's row-sparse gradients, the bag-of-ids data, the lazy
// optimizers, and the rows travelling through ps (real gRPC shards on 127.0.0.1), allreduce and
// averaging (ranks as threads). Small tables, so that it stays fast.
#include <cohort/averaging.h>
#include <cohort/data.h>
#include <cohort/data_parallel.h>
#include <cohort/error.h>
#include <cohort/job.h>
#include <cohort/models.h>
#include <cohort/parameter_server.h>

#include "data/bags.h"
#include "ps/layout.h"
#include "ps/optimizer.h"
#include "ps/service.h"
#include "ps/shard.h"
#include "ps/wire.h"
#include "schemes/model_sync.h"
#include "train/lazy_optimizer.h"
#include "train/trainer.h"

#include "model_util.h"
#include "rank_threads.h"
#include "test_util.h"

#include <torch/torch.h>

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <fstream>

namespace cohort::sparse_test {
namespace {

constexpr int64_t kRows = 40;

InputShape bagShape() { return {.channels = 1, .height = 1, .width = 1, .classes = 2, .featureRows = kRows}; }

torch::nn::Sequential embedModel(bool sparse, uint64_t seed = 3, const std::string& pool = "sum") {
  torch::manual_seed(seed);
  return makeModel("embed:rows=40,dim=4,hidden=8,pool=" + pool + ",sparse=" + (sparse ? "1" : "0"), bagShape());
}

// A batch of bags over the small table, with repeated ids inside bags and across them.
Batch bagBatch(uint64_t seed, int64_t n = 6) {
  SyntheticBagsOptions o{.examples = 60, .rows = kRows, .minIds = 2, .maxIds = 7, .hiddenRows = 10, .seed = seed};
  DataSplits d = makeSyntheticBags(o);
  std::vector<int64_t> idx(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) idx[size_t(i)] = (i * 7 + int64_t(seed)) % d.train.size();
  return makeBatch(d.train, idx);
}

torch::Tensor lossOf(torch::nn::Sequential& m, const Batch& b) {
  return torch::nn::functional::cross_entropy(m->forward(b.inputs), b.targets);
}

torch::Tensor table(torch::nn::Sequential& m) { return m->parameters()[0]; }

void expectSameParameters(torch::nn::Sequential& a, torch::nn::Sequential& b, const std::string& what) {
  auto pa = a->parameters(), pb = b->parameters();
  ASSERT_EQ(pa.size(), pb.size());
  for (size_t i = 0; i < pa.size(); ++i) EXPECT_TRUE(torch::equal(pa[i], pb[i])) << what << ": parameter " << i;
}

TEST(SparseModel, GradientIsTheDenseGradientOnTheTouchedRows) {
  for (const std::string pool : {"sum", "mean"}) {
    auto sparse = embedModel(true, 3, pool), dense = embedModel(false, 3, pool);
    expectSameParameters(sparse, dense, "initialization");
    const Batch b = bagBatch(5, 8);
    lossOf(sparse, b).backward();
    lossOf(dense, b).backward();
    const torch::Tensor gs = table(sparse).grad(), gd = table(dense).grad();
    ASSERT_TRUE(gs.is_sparse());
    ASSERT_FALSE(gd.is_sparse());
    auto [rows, values] = gradientRows(gs);
    const auto touched = std::get<0>(torch::_unique(b.inputs.masked_select(b.inputs.ne(kBagPadding))));
    EXPECT_TRUE(torch::equal(rows, touched)) << pool;
    if (pool == "sum") {
      EXPECT_TRUE(torch::equal(values, gd.index_select(0, rows))) << pool << ": rows differ from the dense gradient";
    } else {
      // mean: torch's dense backward scales by 1/count in another order than the sparse one.
      EXPECT_TRUE(torch::allclose(values, gd.index_select(0, rows), 1e-6, 1e-7)) << pool;
    }
    // Every other row of the dense gradient is zero.
    EXPECT_EQ(gd.ne(0).any(1).sum().item<int64_t>(), rows.numel()) << pool;
    // The dense layers' gradients agree too.
    for (size_t i = 1; i < sparse->parameters().size(); ++i) {
      EXPECT_TRUE(torch::equal(sparse->parameters()[i].grad(), dense->parameters()[i].grad())) << pool << " " << i;
    }
  }
}

TEST(SparseModel, RowsReadAreTheBatchIdsAndRefusesImagesAndSmallTables) {
  auto m = embedModel(true);
  const Batch b = bagBatch(2);
  auto read = rowsRead(m, b.inputs);
  ASSERT_EQ(read.size(), 1u);
  EXPECT_TRUE(read[0].first.is_same(table(m)));
  EXPECT_TRUE(torch::equal(read[0].second, std::get<0>(torch::_unique(b.inputs.masked_select(b.inputs.ge(0))))));
  auto dense = embedModel(false);
  EXPECT_TRUE(rowsRead(dense, b.inputs).empty());  // a dense table is pulled whole
  InputShape small = bagShape();
  small.featureRows = 41;
  small.featureRowsSource = "data.txt:7";
  try {
    makeModel("embed:rows=40", small);
    FAIL() << "a table smaller than the data's ids was accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("data.txt:7: feature id 40 is beyond the model's table of 40 rows"),
              std::string::npos)
        << e.what();
  }
  EXPECT_THROW(makeModel("embed", InputShape{}), InvalidArgument);  // images
  EXPECT_THROW(makeModel("mlp", bagShape()), InvalidArgument);      // bags into an image model
  EXPECT_THROW(makeModel("embed:pool=max", bagShape()), InvalidArgument);
}

// Writes each text to a file of its own and expects loadData("libsvm:FILE") to throw an IoError
// whose message holds FILE followed by the expected suffix.
void expectEachFileRefused(test::TempDir& dir, const std::vector<std::pair<std::string, std::string>>& bad) {
  for (size_t i = 0; i < bad.size(); ++i) {
    const std::string path = dir.file("bad" + std::to_string(i) + ".txt");
    std::ofstream(path) << bad[i].first;
    try {
      loadData("libsvm:" + path, 1);
      ADD_FAILURE() << "accepted " << bad[i].first;
    } catch (const IoError& e) {
      EXPECT_NE(std::string(e.what()).find(path + bad[i].second), std::string::npos) << e.what();
    }
  }
}

// The reader: the line number of the first bad line, for each kind of bad line.
TEST(BagReader, ReadsLibsvmAndVowpalLinesAndRefusesMalformedOnesWithTheLine) {
  test::TempDir dir;
  const std::string good = dir.file("good.txt");
  std::ofstream(good) << "1 3 5:1 7\n# a comment\n\n-1 | 0 2\n0 4 4 9\n1 8\n2 1\n0 6\n";
  DataSplits d = loadData("libsvm:" + good, 1);
  EXPECT_EQ(d.train.size() + d.test.size(), 6);
  EXPECT_EQ(d.test.size(), 1);  // the last sixth
  EXPECT_EQ(d.classes, 3);
  EXPECT_EQ(d.featureRows, 10);
  EXPECT_EQ(d.featureRowsSource, good + ":5");
  EXPECT_EQ(d.train.labels[1].item<int64_t>(), 0);  // -1 is class 0
  Batch b = makeBatch(d.train, std::vector<int64_t>{0, 1});
  EXPECT_TRUE(torch::equal(b.inputs, torch::tensor({{3, 5, 7}, {0, 2, -1}}, torch::kInt64)));

  const std::vector<std::pair<std::string, std::string>> bad = {
      {"1 2\n1 -4 3\n", ":2: the feature id -4 is negative"},
      {"1 2\n0 3\n1\n", ":3: the bag is empty"},
      {"x 2\n", ":1: the label 'x' is not a class"},
      {"1 2\n1 3 abc\n", ":2: the feature 'abc' is not ID or ID:VALUE"},
      {"1 2:0.5\n", ":1: the feature '2:0.5' has value 0.5"},
      {"1 2\n0 3\n1 4:\n", ":3: the feature '4:' has no number after the colon"},
  };
  expectEachFileRefused(dir, bad);
  EXPECT_THROW(loadData("libsvm:" + dir.file("missing.txt"), 1), IoError);
  EXPECT_THROW(loadData("synthetic-bags:0", 1), InvalidArgument);
  expectEachFileRefused(dir, {{"+1 2\n++1 3\n", ":2: the label '++1' is not a class"}});

  // LIBSVM's binary sets label +1 and -1 (a9a: "+1 5:1 7:1"): classes 1 and 0.
  const std::string binary = dir.file("a9a.txt");
  std::ofstream(binary) << "+1 5:1 7:1\n-1 3:1\n+1 2:1\n-1 4:1\n+1 1:1\n-1 6:1\n";
  DataSplits a9a = loadData("libsvm:" + binary, 1);
  EXPECT_EQ(a9a.classes, 2);
  EXPECT_EQ(a9a.train.labels[0].item<int64_t>(), 1);
  EXPECT_EQ(a9a.train.labels[1].item<int64_t>(), 0);
}

// makeBatch checks its indices before reading the bags' offsets (it read and copied past them).
TEST(BagReader, MakeBatchRefusesAnIndexOutsideTheDataSet) {
  DataSplits d = loadData("synthetic-bags:600,1000", 4);
  for (const int64_t bad : {int64_t(100000), int64_t(600), int64_t(-5)}) {
    EXPECT_THROW(makeBatch(d.train, std::vector<int64_t>{0, bad}), InvalidArgument) << bad;
  }
  EXPECT_EQ(makeBatch(d.train, std::vector<int64_t>{0, 599}).targets.size(0), 2);
}

// Labels and ids that would size the model's last layer or its table at gigabytes are refused
// with FILE:LINE and the limit, before a model is made.
TEST(BagReader, RefusesLabelsAndFeatureIdsBeyondTheLimits) {
  test::TempDir dir;
  const std::vector<std::pair<std::string, std::string>> bad = {
      {"1 2\n10000000 3\n", ":2: the label 10000000 is above 4095, the largest class this reader takes"},
      {"2000000000 3\n", ":1: the label 2000000000 is above 4095"},
      {"1 2\n0 5 10000000\n", ":2: the feature id 10000000 is above 8388607, the largest id this reader takes"},
  };
  expectEachFileRefused(dir, bad);
}

TEST(BagReader, SyntheticBagsAreSeededPowerLawWithAKnownOptimum) {
  DataSplits a = loadData("synthetic-bags:600,1000", 4), b = loadData("synthetic-bags:600,1000", 4);
  EXPECT_TRUE(torch::equal(a.train.bagIds, b.train.bagIds));
  EXPECT_EQ(a.train.size(), 600);
  EXPECT_EQ(a.test.size(), 100);
  EXPECT_GT(a.attainableAccuracy, 0.6);
  EXPECT_LT(a.attainableAccuracy, 1.0);
  const auto& ids = a.train.bagIds;
  EXPECT_GE(ids.min().item<int64_t>(), 0);
  EXPECT_LT(ids.max().item<int64_t>(), 1000);
  // A power law: id 0 is far more frequent than ids around 500.
  const auto counts = torch::bincount(ids, {}, 1000);
  EXPECT_GT(counts[0].item<int64_t>(), 20 * std::max<int64_t>(1, counts.narrow(0, 500, 10).sum().item<int64_t>() / 10));
  // Bags of 20 to 50 ids.
  const auto lengths = a.train.bagOffsets.narrow(0, 1, 600) - a.train.bagOffsets.narrow(0, 0, 600);
  EXPECT_GE(lengths.min().item<int64_t>(), 20);
  EXPECT_LE(lengths.max().item<int64_t>(), 50);
}

TEST(SparseLayout, TwoShardsHoldEveryRowOfTheTableExactlyOnce) {
  // A table of 1000 rows of 12 and a dense bias; pieces cut to at most 4000 elements by the
  // even share, so the table is several row ranges.
  const std::vector<ps::ParamInfo> params = {{"table", 12000, 12}, {"bias", 7, 0}};
  const auto pieces = ps::planLayout(params, 2);
  std::vector<int> held(1000, 0);
  std::set<int> shards;
  for (const auto& p : pieces) {
    if (p.param != 0) continue;
    EXPECT_EQ(p.rowDim, 12u);
    EXPECT_EQ(p.offset % 12, 0u) << p.name;
    EXPECT_EQ(p.numel % 12, 0u) << p.name;
    for (uint64_t r = p.offset / 12; r < (p.offset + p.numel) / 12; ++r) held[r] += 1;
    shards.insert(p.shard);
  }
  for (int r = 0; r < 1000; ++r) EXPECT_EQ(held[size_t(r)], 1) << "row " << r;
  EXPECT_EQ(shards.size(), 2u);
  const auto loads = ps::shardLoads(pieces, 2);
  EXPECT_LE(std::max(loads[0], loads[1]) - std::min(loads[0], loads[1]), 12000u / 2);
}

// Lazy optimizers on row-sparse gradients match torch's dense ones on a table whose other rows
// never get a gradient (their state stays zero, so the dense optimizer leaves them too).
TEST(LazyOptimizer, MatchesTorchDenseOptimizersOnTheTouchedRows) {
  for (const std::string name : {"sgd", "momentum", "adam", "adagrad"}) {
    torch::manual_seed(11);
    torch::Tensor lazyTable = torch::randn({10, 3}).requires_grad_(true);
    torch::Tensor denseTable = lazyTable.detach().clone().requires_grad_(true);
    LazyOptimizer lazy({lazyTable}, *parseOptimizer(name), 0.1, 0.9);
    std::unique_ptr<torch::optim::Optimizer> dense;
    if (name == "sgd") dense = std::make_unique<torch::optim::SGD>(std::vector{denseTable}, torch::optim::SGDOptions(0.1));
    if (name == "momentum") {
      dense = std::make_unique<torch::optim::SGD>(std::vector{denseTable}, torch::optim::SGDOptions(0.1).momentum(0.9));
    }
    if (name == "adam") dense = std::make_unique<torch::optim::Adam>(std::vector{denseTable}, torch::optim::AdamOptions(0.1));
    if (name == "adagrad") {
      dense = std::make_unique<torch::optim::Adagrad>(std::vector{denseTable}, torch::optim::AdagradOptions(0.1));
    }
    const auto rows = torch::tensor({1, 4, 7}, torch::kInt64);
    for (int step = 0; step < 4; ++step) {
      const auto g = torch::randn({3, 3});
      lazyTable.mutable_grad() = torch::sparse_coo_tensor(rows.unsqueeze(0), g, {10, 3});
      denseTable.mutable_grad() = torch::zeros({10, 3}).index_copy_(0, rows, g);
      lazy.step();
      dense->step();
    }
    // Not bit for bit: torch's kernels fuse multiply-adds that ps/optimizer.cpp rounds apart.
    EXPECT_TRUE(torch::allclose(lazyTable, denseTable, 1e-5, 1e-5)) << name << "\n" << lazyTable - denseTable;
    // Rows never touched are exactly where they started, in both.
    for (int64_t r : {0, 2, 3, 5, 6, 8, 9}) EXPECT_TRUE(torch::equal(lazyTable[r], denseTable[r])) << name << " row " << r;
  }
}

// Lazy state: a row touched only at the last step starts from zero state, and rows not touched
// are never changed, whatever their neighbours' state.
TEST(LazyOptimizer, UntouchedRowsAndTheirStateStayAsTheyAre) {
  const std::pair<ps::UpdateRule, const char*> rules[] = {
      {ps::UpdateRule::kMomentum, "momentum"}, {ps::UpdateRule::kAdam, "adam"}, {ps::UpdateRule::kAdagrad, "adagrad"}};
  for (const auto& [rule, name] : rules) {
    ps::ServerOptimizer opt(rule, 0.1, 0.9, 6);
    std::vector<float> values(6, 1.0f);
    const std::vector<float> g = {0.5f, -0.25f};
    opt.beginStep();
    opt.applyPart(0, {values.data(), 2}, g, 1.0f);  // row 0 (rows of 2)
    opt.beginStep();
    opt.applyPart(4, {values.data() + 4, 2}, g, 1.0f);  // row 2 only
    EXPECT_EQ(values[2], 1.0f) << name;
    EXPECT_EQ(values[3], 1.0f) << name;
    for (const auto& slot : opt.slots()) {
      EXPECT_EQ(slot[2], 0.0f) << name;
      EXPECT_EQ(slot[3], 0.0f) << name;
    }
  }
}

// The Trainer on a sparse model: the lazy optimizer's state is in its checkpoints, so a resumed
// run ends with the same parameters as an uninterrupted one.
TEST(SparseTrainer, ResumeReachesTheSameParametersAsAnUninterruptedRun) {
  for (const char* optimizer : {"adam", "adagrad"}) {
    TrainOptions full;
    full.model = "embed:rows=300,dim=4,hidden=8";
    full.data = "synthetic-bags:240,300";
    full.batch = 16;
    full.threads = 1;
    full.seed = 3;
    full.progress = ProgressMode::kOff;
    full.optimizer = *parseOptimizer(optimizer);
    full.lr = 0.05;
    full.steps = 20;
    Trainer uninterrupted(full);
    const TrainResult u = uninterrupted.run();
    EXPECT_GT(u.testAccuracy, 0.0);
    test::TempDir dir;
    TrainOptions first = full;
    first.steps = 12;
    first.checkpointDir = dir.path();
    Trainer(first).run();
    TrainOptions second = full;
    second.checkpointDir = dir.path();
    second.resume = true;
    Trainer resumed(second);
    EXPECT_EQ(resumed.run().steps, 20);
    auto a = uninterrupted.model(), b = resumed.model();
    expectSameParameters(a, b, optimizer);
  }
}

// ps: the sparse path (rows pushed, the next batch's rows asked for) ends with the same
// parameters as the same model with a dense table, bit for bit with sgd, over 2 gRPC shards.
struct Shards {
  std::vector<std::unique_ptr<ps::ShardServer>> servers;
  std::vector<std::string> hosts;
  explicit Shards(int n) {
    for (int i = 0; i < n; ++i) {
      servers.push_back(std::make_unique<ps::ShardServer>(ps::ServerOptions{.shard = {.log = [](const std::string&) {}}}));
      hosts.push_back("127.0.0.1:" + std::to_string(servers.back()->port()));
    }
  }
};

std::pair<torch::nn::Sequential, int64_t> trainOnPs(bool sparse, PsMode mode, const std::string& codec, int steps) {
  Shards shards(2);
  auto model = embedModel(sparse);
  ParameterServerClient client(
      Job::single(), *model, nullptr,
      {.mode = mode, .optimizer = PsOptimizer::kSgd, .lr = 0.5, .hosts = shards.hosts, .codec = codec});
  int64_t bytes = 0;
  for (int s = 0; s < steps; ++s) {
    const Batch b = bagBatch(uint64_t(s));
    clearGradients(*model);
    lossOf(model, b).backward();
    if (s + 1 < steps) {
      for (const auto& [t, rows] : rowsRead(model, bagBatch(uint64_t(s + 1)).inputs)) client.prefetchRows(t, rows);
    }
    const ParameterServerStep st = client.step(b.size());
    bytes += st.bytesSent + st.bytesReceived;
  }
  client.finish();  // pulls everything
  return {model, bytes};
}

TEST(SparsePs, RowPushesAndPullsEqualTheDensePathBitForBit) {
  for (const PsMode mode : {PsMode::kSync, PsMode::kAsync}) {
    // sum pooling: the sparse gradient is the dense one's rows bit for bit (test above), and the
    // shards' sgd leaves untouched rows exactly as they are (p - lr * 0 == p).
    auto [sparse, sparseBytes] = trainOnPs(true, mode, "none", 4);
    auto [dense, denseBytes] = trainOnPs(false, mode, "none", 4);
    expectSameParameters(sparse, dense, psModeName(mode));
    EXPECT_GT(sparseBytes, 0);
    EXPECT_GT(denseBytes, 0);
  }
}

// A bfloat16 model on the parameter server (CPU): its gradients go as float32 through a float32
// host copy, the shards keep float32 parameters, and the model gets them back rounded to
// bfloat16. With steps below half a bfloat16 unit of most weights, a bfloat16 model trained alone
// loses most of them in the rounding, while the shards' float32 master weights accumulate them:
// the model follows a float32 run from the same start, rounded.
TEST(DensePs, ABfloat16ModelKeepsFloat32MasterWeightsOnTheShards) {
  const auto make = [](torch::Dtype dtype) {
    torch::manual_seed(12);
    torch::nn::Sequential net(torch::nn::Linear(6, 16), torch::nn::ReLU(), torch::nn::Linear(16, 3));
    net->to(torch::kBFloat16);  // every run starts from the same bfloat16 values
    net->to(dtype);
    return net;
  };
  torch::manual_seed(13);
  const auto x = torch::randn({8, 32, 6});
  const auto y = torch::randint(0, 3, {8, 32});
  const int steps = 64;
  const double lr = 2e-4;  // a step moves a weight by ~1e-4: below half a bfloat16 unit of most
  const auto train = [&](torch::Dtype dtype, bool onPs) {
    auto net = make(dtype);
    Shards shards(2);
    std::unique_ptr<ParameterServerClient> client;
    std::unique_ptr<torch::optim::SGD> opt;
    if (onPs) {
      client = std::make_unique<ParameterServerClient>(
          Job::single(), *net, nullptr,
          ParameterServerOptions{
              .mode = PsMode::kSync, .optimizer = PsOptimizer::kSgd, .lr = lr, .hosts = shards.hosts});
    } else {
      opt = std::make_unique<torch::optim::SGD>(net->parameters(), lr);
    }
    for (int s = 0; s < steps; ++s) {
      clearGradients(*net);
      torch::nn::functional::cross_entropy(net->forward(x[s % 8].to(dtype)), y[s % 8]).backward();
      if (onPs) {
        client->step(32);
      } else {
        opt->step();
      }
    }
    if (client) client->finish();
    std::vector<torch::Tensor> out;  // as bfloat16 values, in float64
    for (const auto& p : net->parameters()) {
      EXPECT_EQ(p.scalar_type(), dtype);
      out.push_back(p.detach().to(torch::kBFloat16).to(torch::kFloat64));
    }
    return out;
  };
  const auto count = [](const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
    int64_t n = 0;
    for (size_t i = 0; i < a.size(); ++i) n += a[i].ne(b[i]).sum().item<int64_t>();
    return n;
  };
  std::vector<torch::Tensor> initial;
  for (const auto& p : make(torch::kBFloat16)->parameters()) initial.push_back(p.detach().to(torch::kFloat64));
  const auto alone = train(torch::kBFloat16, false);
  const auto float32 = train(torch::kFloat32, true);  // rounded to bfloat16
  const auto bf16 = train(torch::kBFloat16, true);
  const int64_t movedAlone = count(alone, initial), moved = count(bf16, initial), apart = count(bf16, float32);
  // Seen: alone 0 of 163 weights moved; on the ps 26, every one where the float32 run's did.
  EXPECT_GE(moved, 10) << "the shards' float32 updates did not reach the model";
  EXPECT_LE(movedAlone, moved / 2) << "bfloat16 SGD alone kept its steps: the test no longer shows master weights";
  EXPECT_LE(apart, moved / 10) << "the model is not the float32 run rounded (its bfloat16 gradients may round a "
                               << "weight across a boundary, not more); " << moved << " moved";
  EXPECT_LE(test::maxDifference(bf16, float32), 8e-3);  // one bfloat16 unit of a weight below 1
  // --push updates would send the change a bfloat16 optimizer made: refused, naming the fix.
  auto net = make(torch::kBFloat16);
  torch::optim::SGD opt(net->parameters(), lr);
  Shards shards(1);
  try {
    ParameterServerClient client(Job::single(), *net, &opt, {.push = PsPush::kUpdates, .hosts = shards.hosts});
    FAIL() << "push updates accepted a bfloat16 model";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("push gradients"), std::string::npos) << e.what();
  }
}

TEST(SparsePs, Fp16RowsTrainCloseToFloat32Rows) {
  auto [half, halfBytes] = trainOnPs(true, PsMode::kSync, "fp16", 3);
  auto [full, fullBytes] = trainOnPs(true, PsMode::kSync, "none", 3);
  EXPECT_LT(halfBytes, fullBytes);
  EXPECT_TRUE(torch::allclose(table(half), table(full), 1e-2, 1e-2));
  EXPECT_FALSE(torch::equal(table(half), table(full)));
}

// The Trainer under ps with a sparse model: every step's push and reply carry rows, never the
// table, also at an epoch's end (the next epoch's first batch is prefetched), before an evaluation
// and at the last step; the whole model travels only in the pulls outside the steps (the first,
// one per evaluation, the last), which the done event counts.
TEST(SparsePs, TrainerStepsCarryRowsAtEpochEndsEvaluationsAndTheLastStep) {
  Shards shards(2);
  test::TempDir dir;
  TrainOptions o;
  o.model = "embed:rows=4000,dim=8,hidden=8";
  o.data = "synthetic-bags:240,4000";
  o.batch = 4;
  o.epochs = 2;  // 60 steps per epoch
  o.evalEvery = 50;
  o.threads = 1;
  o.progress = ProgressMode::kOff;
  o.optimizer = OptimizerKind::kAdagrad;
  o.lr = 0.05;
  o.metricsPath = dir.file("m.jsonl");
  o.strategy.scheme = Scheme::kPs;
  o.strategy.ps.hosts = shards.hosts;
  Trainer trainer(o);
  const TrainResult r = trainer.run();
  ASSERT_EQ(r.steps, 120);
  const int64_t tableBytes = 4000 * 8 * 4;
  const int64_t modelBytes = parameterCount(*trainer.model()) * 4;
  // At most 4 bags x 50 ids, each row an id (<= 5 bytes) and 8 floats, pushed and asked back;
  // the dense layers (8*8+8 + 2*8+2 floats) both ways; framing.
  const int64_t rowsBound = 4 * 50 * (5 + 8 * 4) + (8 * 8 + 8 + 2 * 8 + 2) * 4 + 256;
  ASSERT_LT(rowsBound, tableBytes / 10);
  std::ifstream in(o.metricsPath);
  std::string line;
  int steps = 0;
  int64_t wholePulls = -1;
  while (std::getline(in, line)) {
    const auto j = nlohmann::json::parse(line);
    if (j["event"] == "done") wholePulls = j["whole_model_pull_bytes"].get<int64_t>();
    if (j["event"] != "step") continue;
    ++steps;
    const int64_t step = j["step"].get<int64_t>();
    EXPECT_LE(j["bytes_received"].get<int64_t>(), rowsBound) << "step " << step;
    EXPECT_LE(j["bytes_sent"].get<int64_t>(), rowsBound) << "step " << step;
    EXPECT_GT(j["bytes_received"].get<int64_t>(), 0) << "step " << step;
  }
  EXPECT_EQ(steps, 120);
  // The first pull, the evaluations at steps 50 and 100, the last pull in finish().
  EXPECT_EQ(wholePulls, 4 * modelBytes);
}

// A shard holds only its rows; its checkpoint keeps them, their row width and the lazy optimizer
// state, and a shard restored from it goes on exactly as the original.
TEST(SparsePs, ShardCheckpointsCoverTheRowsAndTheirLazyState) {
  test::TempDir dir;
  ps::wire::Policy policy;
  policy.set_mode(ps::wire::MODE_ASYNC);
  policy.set_workers(1);
  policy.set_softsync(1);
  policy.set_staleness_lr(ps::wire::STALENESS_LR_NONE);
  policy.set_max_staleness(-1);
  policy.set_push(ps::wire::PUSH_GRADIENTS);
  policy.set_optimizer(ps::wire::OPTIMIZER_ADAM);
  policy.set_lr(0.1);
  policy.set_timeout_s(5);
  ps::wire::PieceSpec piece;
  piece.set_key(3);
  piece.set_name("table[rows 0:4]");
  piece.set_numel(8);
  piece.set_row_dim(2);
  auto original = std::make_shared<ps::Shard>(ps::ShardOptions{.checkpointDir = dir.path(), .log = [](const std::string&) {}});
  ps::wire::InitRequest init;
  init.set_protocol(ps::kProtocolVersion);
  *init.mutable_policy() = policy;
  *init.add_pieces() = piece;
  const std::vector<float> start = {1, 2, 3, 4, 5, 6, 7, 8};
  ps::setTensor(init.add_values(), piece, start.data());
  ps::wire::InitReply initReply;
  ASSERT_TRUE(original->init(init, &initReply).ok());
  int64_t clock = 0;
  auto push = [&](ps::Shard& shard, std::vector<uint32_t> rows, std::vector<float> g) {
    ps::wire::PushRequest r;
    r.set_protocol(ps::kProtocolVersion);
    r.set_clock(clock++);
    r.set_row_sparse(true);
    r.set_want_values(true);
    r.set_want_all_rows(true);
    auto* rr = r.add_rows();
    rr->set_key(3);
    rr->set_dtype(ps::wire::FLOAT32);
    rr->mutable_rows()->Add(rows.begin(), rows.end());
    rr->set_data(reinterpret_cast<const char*>(g.data()), g.size() * sizeof(float));
    ps::wire::PushReply reply;
    const ps::Status s = shard.push(r, &reply);
    EXPECT_TRUE(s.ok()) << s.message;
    std::vector<float> out(8);
    std::memcpy(out.data(), reply.values(0).data().data(), 32);
    return out;
  };
  auto afterFirst = push(*original, {1, 3}, {0.5f, -1, 2, 0.25f});
  EXPECT_EQ(afterFirst[0], 1.0f);  // rows 0 and 2 untouched
  EXPECT_EQ(afterFirst[5], 6.0f);
  EXPECT_NE(afterFirst[2], 3.0f);
  original->checkpoint();
  auto restored = std::make_shared<ps::Shard>(ps::ShardOptions{.checkpointDir = dir.path(), .log = [](const std::string&) {}});
  const int64_t at = clock;
  auto a = push(*original, {0, 3}, {1, 1, -1, -1});
  clock = at;
  auto b = push(*restored, {0, 3}, {1, 1, -1, -1});
  EXPECT_EQ(a, b);  // the same values and Adam moments came back
  // A push of rows outside the piece is refused, naming them.
  ps::wire::PushRequest bad;
  bad.set_protocol(ps::kProtocolVersion);
  bad.set_clock(clock++);
  bad.set_row_sparse(true);
  auto* rr = bad.add_rows();
  rr->set_key(3);
  rr->set_dtype(ps::wire::FLOAT32);
  rr->add_rows(4);
  rr->set_data(std::string(8, '\0'));
  ps::wire::PushReply reply;
  const ps::Status s = restored->push(bad, &reply);
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message.find("has 4 rows, got row 4"), std::string::npos) << s.message;
}

// allreduce: two ranks with half a batch each equal one process with the whole batch; the
// replicas stay bit-identical; bytes are far below the dense table's.
TEST(SparseAllreduce, RanksEqualOneProcessWithTheCombinedBatch) {
  for (const std::string codec : {"none", "bf16"}) {
    const Batch whole = bagBatch(9, 8);
    auto reference = embedModel(true);
    LazyOptimizer refOpt(reference->parameters(), OptimizerKind::kSgd, 0.5, 0);
    for (int s = 0; s < 3; ++s) {
      refOpt.zero_grad();
      lossOf(reference, whole).backward();
      refOpt.step();
    }
    std::vector<std::vector<torch::Tensor>> finals(2);
    std::vector<int64_t> bytes(2);
    // Built here, not in the rank threads: torch's generator is one per process, and two threads
    // seeding it at once build different models (the reference would then not be rank 0's start).
    std::vector<torch::nn::Sequential> models = {embedModel(true), embedModel(true)};
    test::onRanks(2, [&](std::shared_ptr<Communicator> comm) {
      const int r = comm->rank();
      auto& model = models[size_t(r)];
      LazyOptimizer opt(model->parameters(), OptimizerKind::kSgd, 0.5, 0);
      // bf16 also with findUnusedParameters: every parameter is used, so nothing may change.
      DataParallel dp(Job::fromCommunicator(comm), *model, {.codec = codec, .findUnusedParameters = codec == "bf16"});
      Batch mine{whole.inputs.narrow(0, r * 4, 4), whole.targets.narrow(0, r * 4, 4)};
      for (int s = 0; s < 3; ++s) {
        opt.zero_grad();
        lossOf(model, mine).backward();
        ASSERT_TRUE(table(model).grad().is_sparse());
        opt.step();
      }
      for (const auto& p : model->parameters()) finals[size_t(r)].push_back(p.detach().clone());
      bytes[size_t(r)] = dp.stats().bytesSent;
    });
    for (size_t i = 0; i < finals[0].size(); ++i) {
      EXPECT_TRUE(torch::equal(finals[0][i], finals[1][i])) << codec << ": replicas differ in parameter " << i;
      const double tol = codec == "none" ? 1e-5 : 2e-2;
      EXPECT_TRUE(torch::allclose(finals[0][i], reference->parameters()[i], tol, tol)) << codec << " parameter " << i;
    }
    // The table is 40 x 4 floats: at most 4 bags x 7 ids = 28 rows of (8 + 16) bytes per step.
    EXPECT_LE(bytes[0], 3 * (28 * (8 + 16) + 4 * (4 * 8 + 8 + 8 * 2 + 2) + 64)) << codec;
  }
}

// average: replicas agree after an average, and only the rows that changed travel.
TEST(SparseAverage, OnlyChangedRowsTravelAndReplicasAgree) {
  std::vector<std::vector<torch::Tensor>> finals(2);
  std::vector<int64_t> bytes(2);
  std::vector<torch::nn::Sequential> models = {embedModel(true), embedModel(true)};  // not in the threads
  test::onRanks(2, [&](std::shared_ptr<Communicator> comm) {
    const int r = comm->rank();
    auto& model = models[size_t(r)];
    LazyOptimizer opt(model->parameters(), OptimizerKind::kSgd, 0.5, 0);
    ParameterAveraging avg(Job::fromCommunicator(comm), *model, &opt, {.period = 2});
    const torch::Tensor start = table(model).detach().clone();
    torch::Tensor changed = torch::zeros({kRows}, torch::kBool);
    for (int s = 0; s < 2; ++s) {
      const Batch b = bagBatch(uint64_t(10 * r + s), 3);
      changed |= torch::zeros({kRows}, torch::kBool).index_fill_(0, b.inputs.masked_select(b.inputs.ge(0)), true);
      opt.zero_grad();
      lossOf(model, b).backward();
      opt.step();
      avg.step();
    }
    for (const auto& p : model->parameters()) finals[size_t(r)].push_back(p.detach().clone());
    bytes[size_t(r)] = avg.stats().bytesSent;
    // The dense layers (8*4+8 + 2*8+2 floats) travel whole; the table's rows only where changed.
    const int64_t denseBytes = (4 * 8 + 8 + 8 * 2 + 2) * 4;
    EXPECT_LE(avg.stats().bytesSent, denseBytes + changed.sum().item<int64_t>() * (8 + 16)) << "rank " << r;
    EXPECT_LT(avg.stats().bytesSent, denseBytes + kRows * 4 * 4) << "rank " << r;
    (void)start;
  });
  for (size_t i = 0; i < finals[0].size(); ++i) EXPECT_TRUE(torch::equal(finals[0][i], finals[1][i])) << i;
}

}  // namespace
}  // namespace cohort::sparse_test
