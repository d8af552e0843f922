#include "strategy/local.h"

#include <cohort/error.h>

#include <torch/torch.h>

#include <chrono>

namespace cohort {

torch::Tensor forwardBackwardStep(torch::nn::Sequential& model, torch::optim::Optimizer& optimizer,
                                  const Batch& batch, const LossFn& loss) {
  clearGradients(*model);
  auto value = loss(model->forward(batch.inputs), batch.targets);
  value.backward();
  optimizer.step();
  return value;
}

void LocalStrategy::attach(torch::nn::Sequential model, torch::optim::Optimizer& optimizer) {
  model_ = std::move(model);
  optimizer_ = &optimizer;
}

StepStats LocalStrategy::step(const Batch& batch, const LossFn& loss) {
  COHORT_CHECK(optimizer_ != nullptr, Error, "LocalStrategy::step before attach");
  const auto start = std::chrono::steady_clock::now();
  auto value = forwardBackwardStep(model_, *optimizer_, batch, loss);
  StepStats stats;
  stats.loss = value.item<double>();
  stats.samples = batch.size();
  stats.computeSeconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return stats;
}

}  // namespace cohort
