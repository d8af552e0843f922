// Where one training step's time goes, single process: batch gather, forward, backward,
// optimizer. Medians over many steps.
//   build/bench/step_profile [mlp|cnn] [steps] [threads]
#include <cohort/data.h>
#include <cohort/models.h>

#include "train/threads.h"

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <numeric>

using Clock = std::chrono::steady_clock;

static double ms(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

static double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

int main(int argc, char** argv) {
  const std::string modelName = argc > 1 ? argv[1] : "mlp";
  const int steps = argc > 2 ? std::atoi(argv[2]) : 300;
  cohort::setComputeThreads(argc > 3 ? std::atoi(argv[3]) : 1);
  torch::manual_seed(1);
  auto data = cohort::loadData("fashion-mnist", 1);
  auto model = cohort::makeModel(modelName, {});
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
  std::vector<double> gather, fwd, bwd, step;
  std::vector<int64_t> idx(64);
  for (int s = 0; s < steps; ++s) {
    std::iota(idx.begin(), idx.end(), int64_t(s * 64) % 59000);
    auto t0 = Clock::now();
    auto batch = cohort::makeBatch(data.train, idx);
    auto t1 = Clock::now();
    for (auto& p : model->parameters()) p.mutable_grad().reset();
    auto loss = torch::nn::functional::cross_entropy(model->forward(batch.inputs), batch.targets);
    auto t2 = Clock::now();
    loss.backward();
    auto t3 = Clock::now();
    opt.step();
    loss.item<double>();
    auto t4 = Clock::now();
    if (s >= 5) {
      gather.push_back(ms(t0, t1));
      fwd.push_back(ms(t1, t2));
      bwd.push_back(ms(t2, t3));
      step.push_back(ms(t3, t4));
    }
  }
  std::printf("%s median ms: gather %.3f forward %.3f backward %.3f optimizer %.3f\n", modelName.c_str(),
              median(gather), median(fwd), median(bwd), median(step));
}
