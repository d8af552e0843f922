// AllreduceStrategy with ranks as threads over a TCPStore on 127.0.0.1.
#include <cohort/communicator.h>

#include "strategy/allreduce.h"

#include <torch/torch.h>


#include "rank_threads.h"

namespace cohort::allreduce_test {
namespace {

// A layer that only some ranks use in their forward pass.
struct SometimesImpl : torch::nn::Module {
  explicit SometimesImpl(bool used) : used(used), linear(register_module("linear", torch::nn::Linear(4, 4))) {}
  torch::Tensor forward(const torch::Tensor& x) { return used ? linear->forward(x) : x; }
  bool used;
  torch::nn::Linear linear;
};
TORCH_MODULE(Sometimes);

using test::onRanks;

torch::Tensor mse(const torch::Tensor& out, const torch::Tensor& target) { return (out - target).pow(2).mean(); }

// Rank 1 never uses the middle layer: its gradient there counts as zero, nothing hangs, and the
// replicas stay identical.
TEST(Allreduce, UnusedParametersDoNotHangAndReplicasAgree) {
  std::vector<std::vector<torch::Tensor>> finals(2);
  onRanks(2, [&](std::shared_ptr<Communicator> comm) {
    const int rank = comm->rank();
    torch::nn::Sequential model(torch::nn::Linear(4, 4), Sometimes(rank == 0), torch::nn::Linear(4, 2));
    {
      torch::NoGradGuard g;
      for (auto& p : model->parameters()) p.fill_(0.1 * (rank + 1));  // differ: attach must broadcast
    }
    torch::optim::SGD opt(model->parameters(), 0.1);
    AllreduceStrategy strategy(comm, {.bucketMb = 1e-6, .firstBucketMb = 1e-6});  // a bucket per tensor
    strategy.attach(model, opt);
    EXPECT_EQ(strategy.bucketCount(), 6u);
    for (int step = 0; step < 5; ++step) {
      Batch batch{torch::full({8, 4}, 0.5f + float(rank)), torch::ones({8, 2})};
      auto stats = strategy.step(batch, mse);
      EXPECT_EQ(stats.samples, 16);
      EXPECT_GT(stats.bytesSent, 0);
    }
    for (auto& p : model->parameters()) finals[size_t(rank)].push_back(p.detach().clone());
  });
  ASSERT_EQ(finals[0].size(), finals[1].size());
  for (size_t i = 0; i < finals[0].size(); ++i) EXPECT_TRUE(torch::equal(finals[0][i], finals[1][i])) << i;
  // The middle layer moved (rank 0's gradient, halved), so it was not simply skipped.
  EXPECT_FALSE(torch::allclose(finals[0][2], torch::full_like(finals[0][2], 0.1)));
}

}  // namespace
}  // namespace cohort::allreduce_test
