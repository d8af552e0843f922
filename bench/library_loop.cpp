// The library from a user's loop: the cnn on Fashion-MNIST under cohort::DataParallel, with the
// settings `cohort train --strategy allreduce` uses (batch 64 per worker, momentum SGD, lr 0.01),
// so that bench/library.py can put the two side by side. Rank 0 prints one JSON line:
// samples_per_s over all workers, steps after the first 5.
//
//   cohort launch -n 2 -- build/bench/library_loop --steps 300 [--zero-grad] [--find-unused-parameters]
//
// --zero-grad calls optimizer.zero_grad() (the usual loop; libtorch 1.13 zero-fills .grad, which
// costs the hooks an addition); without it the gradients are dropped as `cohort train` does.
// --find-unused-parameters sets DataParallelOptions::findUnusedParameters (every parameter is used
// here: what it costs is its allreduce of an int32 per parameter per step).
#include <cohort/cohort.h>
#include <cohort/models.h>

#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>

int main(int argc, char** argv) try {
  int64_t steps = 300, batch = 64;
  bool zeroGrad = false, findUnused = false;
  std::string model = "cnn";
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--steps") && i + 1 < argc) steps = std::stoll(argv[++i]);
    else if (!std::strcmp(argv[i], "--batch") && i + 1 < argc) batch = std::stoll(argv[++i]);
    else if (!std::strcmp(argv[i], "--model") && i + 1 < argc) model = argv[++i];
    else if (!std::strcmp(argv[i], "--zero-grad")) zeroGrad = true;
    else if (!std::strcmp(argv[i], "--find-unused-parameters"))
      findUnused = true;
    else throw std::invalid_argument(std::string("unknown argument ") + argv[i]);
  }
  torch::set_num_threads(1);
  torch::manual_seed(1);
  const auto data = cohort::loadData("fashion-mnist", 1);
  auto net = cohort::makeModel(model, {data.channels(), data.height(), data.width(), data.classes});
  cohort::ForeachSGD optimizer(net->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));

  auto job = cohort::Job::fromEnvironment();
  cohort::DataParallel dp(
      job, *net, {.buffers = cohort::DataParallelOptions::Buffers::kOnRequest, .findUnusedParameters = findUnused});
  cohort::DistributedSampler sampler(data.train.size(), job, 1);

  const std::vector<int64_t> order = sampler.indices(0);
  const int64_t perEpoch = int64_t(order.size()) / batch;
  double timed = 0;
  int64_t samples = 0;
  for (int64_t step = 0; step < steps; ++step) {
    const auto start = std::chrono::steady_clock::now();
    const int64_t k = step % perEpoch;
    auto b = cohort::makeBatch(data.train, std::span(order).subspan(size_t(k * batch), size_t(batch)));
    if (zeroGrad) {
      optimizer.zero_grad();
    } else {
      for (auto& p : net->parameters()) p.mutable_grad().reset();
    }
    auto loss = torch::nn::functional::cross_entropy(net->forward(b.inputs), b.targets);
    loss.backward();
    optimizer.step();
    loss.item<double>();
    if (step >= 5) {
      timed += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      samples += batch * job.worldSize();
    }
  }
  if (job.isChief()) {
    const auto s = dp.stats();
    std::printf("{\"samples_per_s\": %.2f, \"steps\": %lld, \"comm_wait_s\": %.4f, \"bytes_sent\": %lld}\n",
                double(samples) / timed, (long long)steps, s.commWaitSeconds, (long long)s.bytesSent);
  }
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "library_loop: error: %s\n", e.what());
  return 1;
}
