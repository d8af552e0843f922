// The same loop as resnet_ddp.cpp with the other data-parallel schemes of the library, one switch:
//   cohort launch -n 2 -- ./resnet_schemes --scheme average --period 4
//   cohort launch -n 2 --ps 1 -- ./resnet_schemes --scheme ps
// Lines marked [cohort] are what each scheme adds to the single-process loop.
#include <cohort/cohort.h>  // [cohort]

#include <cstdio>
#include <optional>

#include "resnet.h"

int main(int argc, char** argv) try {
  const Args args(argc, argv);
  auto job = cohort::Job::fromEnvironment();                                   // [cohort]
  // Under `cohort launch --ps M` this same program runs on the shards too (TensorFlow's convention).
  if (job.role() == cohort::Role::kParameterServer) {                          // [cohort] ps
    return cohort::serveParameterServerShard(job, {.authToken = authToken()});  // [cohort] ps
  }
  torch::manual_seed(1);
  const auto data = cohort::loadData("fashion-mnist", 1);
  ResNet net;
  torch::optim::SGD optimizer(net->parameters(), torch::optim::SGDOptions(args.lr).momentum(0.9));
  cohort::DistributedSampler sampler(data.train.size(), job, /*seed=*/1);      // [cohort]

  std::optional<cohort::ParameterAveraging> average;
  std::optional<cohort::ParameterServerClient> ps;
  if (args.scheme == "average") {
    average.emplace(job, *net, &optimizer, cohort::AveragingOptions{.period = args.period});  // [cohort] average
  } else if (args.scheme == "ps") {
    // The shards run the optimizer (momentum SGD here); the worker pushes gradients.
    ps.emplace(job, *net, nullptr,  // [cohort] ps
               cohort::ParameterServerOptions{.mode = cohort::PsMode::kAsync,
                                              .optimizer = cohort::PsOptimizer::kMomentum,
                                              .lr = args.lr,
                                              .authToken = authToken()});
  } else {
    throw std::invalid_argument("--scheme must be average or ps, got " + args.scheme);
  }

  int64_t step = 0;
  for (int64_t epoch = 0; epoch < args.epochs; ++epoch) {
    const std::vector<int64_t> order = sampler.indices(epoch);                 // [cohort]
    for (size_t at = 0; at + size_t(args.batch) <= order.size(); at += size_t(args.batch)) {
      if (args.steps > 0 && step >= args.steps) break;
      auto batch = cohort::makeBatch(data.train, std::span(order).subspan(at, size_t(args.batch)));
      optimizer.zero_grad();
      auto loss = torch::nn::functional::cross_entropy(net->forward(batch.inputs), batch.targets);
      loss.backward();
      if (ps) {
        ps->step(batch.size());                                                // [cohort] ps (instead of optimizer.step())
      } else {
        optimizer.step();
        average->step();                                                       // [cohort] average
      }
      if (++step % 100 == 0 && job.isChief()) std::printf("step %lld loss %.4f\n", (long long)step, loss.item<double>());
    }
  }
  if (average) average->synchronize();                                         // [cohort] average
  if (ps) ps->finish();                                                        // [cohort] ps
  if (job.isChief()) {                                                         // [cohort]
    std::printf("done: %s, %lld steps, test accuracy %.4f (%d workers)\n", args.scheme.c_str(), (long long)step,
                testAccuracy(net, data.test), job.worldSize());
  }
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "resnet_schemes: error: %s\n", e.what());
  return 1;
}
