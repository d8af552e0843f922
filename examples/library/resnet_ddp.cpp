// A user's own training loop for a ResNet on Fashion-MNIST, distributed by data parallelism.
// The lines marked [cohort] are all that distribution adds to the single-process loop; run it as
//   cohort launch -n 2 -- ./resnet_ddp --epochs 1
// or alone (./resnet_ddp), where the same code trains in one process.
#include <cohort/cohort.h>  // [cohort]

#include <chrono>
#include <cstdio>
#include <optional>

#include "resnet.h"

int main(int argc, char** argv) try {
  const Args args(argc, argv);
  torch::manual_seed(1);
  const auto data = cohort::loadData("fashion-mnist", 1);
  ResNet net;
  auto job = cohort::Job::fromEnvironment();                                  // [cohort]
  const torch::Device device = job.device();  // [cohort] the local rank's GPU when there is one, else the CPU
  net->to(device);
  // Optional: cohort's torch::optim::SGD stepped with multi-tensor kernels (as Python's SGD on a GPU).
  cohort::ForeachSGD optimizer(net->parameters(), torch::optim::SGDOptions(args.lr).momentum(0.9));

  cohort::DataParallel dp(job, *net, {.codec = args.codec});                  // [cohort]
  cohort::DistributedSampler sampler(data.train.size(), job, /*seed=*/1);     // [cohort]

  // --autocast fp16: float16's small gradients underflow without loss scaling.
  std::optional<cohort::GradScaler> scaler;
  if (args.autocast == torch::kHalf) scaler.emplace();

  int64_t step = 0;
  double trainSeconds = 0;
  for (int64_t epoch = 0; epoch < args.epochs; ++epoch) {
    const std::vector<int64_t> order = sampler.indices(epoch);                // [cohort] (was: a shuffle of all)
    for (size_t at = 0; at + size_t(args.batch) <= order.size(); at += size_t(args.batch)) {
      if (args.steps > 0 && step >= args.steps) break;
      const auto start = std::chrono::steady_clock::now();
      auto batch = cohort::makeBatch(data.train, std::span(order).subspan(at, size_t(args.batch)));
      // Pinned first, so that the copy to a GPU does not block the host (nothing to do on the CPU).
      const bool gpu = device.is_cuda();
      const auto inputs = gpu ? batch.inputs.pin_memory().to(device, /*non_blocking=*/true) : batch.inputs;
      const auto targets = gpu ? batch.targets.pin_memory().to(device, /*non_blocking=*/true) : batch.targets;
      optimizer.zero_grad();
      torch::Tensor loss;
      {
        // --autocast: convolutions and linear layers in 16 bits, backward after the scope.
        std::optional<cohort::Autocast> mixed;
        if (args.autocast) mixed.emplace(device.type(), *args.autocast);
        loss = torch::nn::functional::cross_entropy(net->forward(inputs), targets);
      }
      if (scaler) {
        // DataParallel averages the scaled gradients; every rank unscales the same averages and so
        // skips the same steps.
        scaler->scale(loss).backward();
        if (scaler->unscale(net->parameters())) optimizer.step();
      } else {
        loss.backward();
        optimizer.step();
      }
      // Reading the loss waits for the step's kernels: on a GPU, the time below is the step's, not
      // the host's time to queue it.
      const double value = loss.item<double>();
      if (++step > 5) trainSeconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      if (step % 100 == 0 && job.isChief()) std::printf("step %lld loss %.4f\n", (long long)step, value);
    }
  }
  if (job.isChief()) {                                                        // [cohort]
    const double rate = trainSeconds > 0 ? double((step - 5) * args.batch * job.worldSize()) / trainSeconds : 0;
    const auto comm = dp.stats();
    std::printf("done: %lld steps, test accuracy %.4f, %.1f samples/s (%d workers), waited %.2f s for "
                "communication, sent %.1f MB\n",
                (long long)step, testAccuracy(net, data.test), rate, job.worldSize(), comm.commWaitSeconds,
                double(comm.bytesSent) / 1e6);
  }
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "resnet_ddp: error: %s\n", e.what());
  return 1;
}
