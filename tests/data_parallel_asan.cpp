// Under AddressSanitizer (g++'s; see tests/CMakeLists.txt for why not clang): a DataParallel handle destroyed mid-run
// leaves a model that trains on alone without touching freed memory. Two ranks as threads over a
// TCPStore on 127.0.0.1; each trains 3 steps under the handle, destroys it, and trains 3 more
// (zero_grad on the .grad tensors the handle made, backward, step); then a noSync() guard outlives
// a handle. ASan aborts the process on a use after free; the checks below fail it on wrong
// results. Exit status 0: passed.
#include <cohort/communicator.h>
#include <cohort/data_parallel.h>
#include <cohort/error.h>

#include <torch/torch.h>

#include <cstdio>
#include <optional>
#include <vector>

#include "rank_threads.h"

namespace {

struct NetImpl : torch::nn::Module {
  NetImpl() : a(register_module("a", torch::nn::Linear(4, 8))), b(register_module("b", torch::nn::Linear(8, 3))) {}
  torch::Tensor forward(const torch::Tensor& x) { return b(torch::relu(a(x)) + torch::relu(a(x))); }
  torch::nn::Linear a, b;
};
TORCH_MODULE(Net);

void rank(std::shared_ptr<cohort::Communicator> comm, std::vector<torch::Tensor>& grads) {
  const int r = comm->rank();
  Net net;
  {
    // Every hidden unit alive for both ranks' inputs (|w.x| <= 1.5 x 4 x 0.5 = 3): with the default
    // initialization all 8 could be dead at both, about once in 256 runs, and then the ranks'
    // outputs, hence gradients, are equal without the handle. A small learning rate keeps the
    // softmax from saturating, where every gradient is exactly 0 (a fresh clone's run, 2026-11-26).
    torch::NoGradGuard noGrad;
    net->a->bias.fill_(3.5f);
  }
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
  auto x = torch::full({4, 4}, 0.5f + float(r));
  auto y = torch::zeros({4}, torch::kInt64);
  {
    auto dp = std::make_unique<cohort::DataParallel>(cohort::Job::fromCommunicator(comm), *net,
                                                     cohort::DataParallelOptions{.codec = "topk:0.5"});
    for (int s = 0; s < 3; ++s) {
      opt.zero_grad();
      torch::nn::functional::cross_entropy(net->forward(x), y).backward();
      opt.step();
    }
    dp.reset();  // mid-run: its hooks, buckets and encoders go
  }
  for (int s = 0; s < 3; ++s) {
    opt.zero_grad();  // on the .grad tensors over the handle's buckets
    torch::nn::functional::cross_entropy(net->forward(x), y).backward();
    opt.step();
  }
  for (auto& p : net->parameters()) grads.push_back(p.grad().clone());
  // A noSync() guard that outlives its handle: ending it must not touch the handle's memory.
  std::optional<cohort::DataParallel::NoSync> guard;
  {
    cohort::DataParallel dp(cohort::Job::fromCommunicator(comm), *net);
    guard.emplace(dp.noSync());
  }
  guard.reset();
}

}  // namespace

int main() {
  try {
    std::vector<std::vector<torch::Tensor>> grads(2);
    cohort::test::onRanks(2, [&](std::shared_ptr<cohort::Communicator> comm) { rank(comm, grads[size_t(comm->rank())]); });
    // Alone, each rank's last gradient is its own (different data): the handle no longer averages.
    bool differ = false;
    for (size_t i = 0; i < grads[0].size(); ++i) differ = differ || !torch::equal(grads[0][i], grads[1][i]);
    if (!differ) {
      std::fprintf(stderr, "FAIL: after the handle was destroyed the ranks' gradients are still equal\n");
      return 1;
    }
    std::printf("data_parallel_asan: passed\n");
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "FAIL: %s\n", e.what());
    return 1;
  }
}
