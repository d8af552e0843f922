// A parameter without a gradient in a step (an unused branch, a frozen layer: its grad undefined)
// is left alone by the parameter server, as torch's optimizers leave it: its value and its
// optimizer state (momentum, Adam's moments and step count) do not move, in every mode, framed,
// streamed, row-sparse and under a codec, over in-process gRPC shards.
#include <cohort/job.h>
#include <cohort/parameter_server.h>

#include "ps/service.h"
#include "schemes/model_sync.h"

#include <torch/torch.h>

#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

namespace cohort::ps_no_gradient_test {
namespace {

struct Shards {
  std::vector<std::unique_ptr<ps::ShardServer>> servers;
  std::vector<std::string> hosts;
  explicit Shards(int n) {
    for (int i = 0; i < n; ++i) {
      servers.push_back(
          std::make_unique<ps::ShardServer>(ps::ServerOptions{.shard = {.log = [](const std::string&) {}}}));
      hosts.push_back("127.0.0.1:" + std::to_string(servers.back()->port()));
    }
  }
};

// Two branches; forward(x, both) uses the second only when asked. With `table`, a sparse
// embedding first (its gradient row-sparse: pushes then go as protobuf with rows).
struct TwoBranchesImpl : torch::nn::Module {
  explicit TwoBranchesImpl(bool table) {
    used = register_module("used", torch::nn::Linear(8, 4));
    branch = register_module("branch", torch::nn::Linear(8, 4));
    if (table) embed = register_module("embed", torch::nn::Embedding(torch::nn::EmbeddingOptions(10, 8).sparse(true)));
  }
  torch::Tensor forward(const torch::Tensor& x, bool both) {
    torch::Tensor in = x;
    if (embed) in = in + embed->forward(torch::arange(x.size(0)) % 10);
    torch::Tensor out = used->forward(in);
    if (both) out = out + branch->forward(in);
    return out;
  }
  torch::nn::Linear used{nullptr}, branch{nullptr};
  torch::nn::Embedding embed{nullptr};
};
TORCH_MODULE(TwoBranches);

struct Case {
  PsMode mode;
  PsOptimizer optimizer;
  double pushChunkMb;  // > 0 and small: pushes stream in chunks
  bool table;
  std::string what;
  std::string codec = "none";
};

std::vector<torch::Tensor> valuesOf(torch::nn::Linear& layer) {
  return {layer->weight.detach().clone(), layer->bias.detach().clone()};
}

// Step 0 trains both branches (a momentum buffer, Adam's moments for the branch); steps 1 and 2
// leave the branch without a gradient: it must stay as step 0 left it. Step 3 trains it again:
// it moves then (the shard still serves it).
void expectTheBranchStays(const Case& c) {
  SCOPED_TRACE(c.what);
  torch::manual_seed(7);
  TwoBranches model(c.table);
  Shards shards(2);
  ParameterServerClient client(Job::single(), *model, nullptr,
                               {.mode = c.mode,
                                .optimizer = c.optimizer,
                                .lr = 0.1,
                                .momentum = 0.9,
                                .hosts = shards.hosts,
                                .pushChunkMb = c.pushChunkMb,
                                .codec = c.codec});
  const auto x = torch::randn({16, 8});
  auto step = [&](bool both) {
    clearGradients(*model);
    model->forward(x, both).pow(2).sum().backward();
    ASSERT_EQ(model->branch->weight.grad().defined(), both);
    client.step(16);
  };
  step(true);
  const auto afterFirst = valuesOf(model->branch);
  const auto usedBefore = valuesOf(model->used);
  step(false);
  step(false);
  const auto afterUnused = valuesOf(model->branch);
  EXPECT_TRUE(torch::equal(afterUnused[0], afterFirst[0])) << "the branch's weight moved without a gradient";
  EXPECT_TRUE(torch::equal(afterUnused[1], afterFirst[1])) << "the branch's bias moved without a gradient";
  EXPECT_FALSE(torch::equal(valuesOf(model->used)[0], usedBefore[0])) << "the used branch did not train";
  step(true);
  EXPECT_FALSE(torch::equal(valuesOf(model->branch)[0], afterFirst[0])) << "the branch no longer trains";
  client.finish();
}

TEST(PsNoGradient, AParameterWithoutAGradientKeepsItsValueAndOptimizerStateInEveryMode) {
  // ~1 KB a shard per push: 256 bytes a chunk streams every push in several chunks.
  const double streamed = 256.0 / double(1 << 20);
  for (const Case& c : {
           Case{PsMode::kSync, PsOptimizer::kMomentum, 0, false, "sync, momentum, framed"},
           Case{PsMode::kAsync, PsOptimizer::kMomentum, 0, false, "async, momentum, framed"},
           Case{PsMode::kSoftsync, PsOptimizer::kAdam, 0, false, "softsync, adam, framed"},
           Case{PsMode::kSsp, PsOptimizer::kAdam, 0, false, "ssp, adam, framed"},
           Case{PsMode::kSync, PsOptimizer::kMomentum, streamed, false, "sync, momentum, streamed"},
           Case{PsMode::kAsync, PsOptimizer::kAdam, streamed, false, "async, adam, streamed"},
           Case{PsMode::kSync, PsOptimizer::kMomentum, 0, true, "sync, momentum, row-sparse push"},
           Case{PsMode::kAsync, PsOptimizer::kAdam, 0, true, "async, adam, row-sparse push"},
           Case{PsMode::kSync, PsOptimizer::kMomentum, 0, false, "sync, momentum, onebit", "onebit"},
           Case{PsMode::kAsync, PsOptimizer::kAdam, 0, false, "async, adam, topk", "topk:0.5"},
           Case{PsMode::kSoftsync, PsOptimizer::kMomentum, 0, true, "softsync, momentum, row-sparse, fp16", "fp16"},
       }) {
    expectTheBranchStays(c);
  }
}

// --push updates: the worker's own optimizer skips the branch (torch's rule), and the shard adds
// the change it made: none.
TEST(PsNoGradient, PushUpdatesLeaveAParameterWithoutAGradientAlone) {
  for (const PsMode mode : {PsMode::kSync, PsMode::kAsync}) {
    torch::manual_seed(7);
    TwoBranches model(false);
    torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9).weight_decay(0.01));
    Shards shards(1);
    ParameterServerClient client(Job::single(), *model, &opt,
                                 {.mode = mode, .push = PsPush::kUpdates, .hosts = shards.hosts});
    const auto x = torch::randn({16, 8});
    auto step = [&](bool both) {
      clearGradients(*model);
      model->forward(x, both).pow(2).sum().backward();
      opt.step();
      client.step(16);
    };
    step(true);
    const auto afterFirst = valuesOf(model->branch);
    step(false);
    step(false);
    EXPECT_TRUE(torch::equal(valuesOf(model->branch)[0], afterFirst[0])) << psModeName(mode);
    client.finish();
  }
}

}  // namespace
}  // namespace cohort::ps_no_gradient_test
