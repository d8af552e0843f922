#include "strategy/local.h"

#include <cohort/autocast.h>
#include <cohort/error.h>

#include <torch/torch.h>

#include <chrono>

namespace cohort {

torch::Tensor forwardLoss(torch::nn::SequentialImpl& model, const torch::Tensor& inputs, const torch::Tensor& targets,
                          const LossFn& loss, std::optional<c10::ScalarType> autocast) {
  if (!autocast) return loss(model.forward(inputs), targets);
  Autocast scope(inputs.device().type(), *autocast);
  return loss(model.forward(inputs), targets);
}

bool backwardAndStep(const torch::Tensor& loss, torch::nn::Module& model, torch::optim::Optimizer& optimizer,
                     GradScaler* scaler) {
  if (scaler == nullptr) {
    loss.backward();
    optimizer.step();
    return true;
  }
  scaler->scale(loss).backward();
  if (!scaler->unscale(model.parameters())) return false;
  optimizer.step();
  return true;
}

torch::Tensor forwardBackwardStep(torch::nn::Sequential& model, torch::optim::Optimizer& optimizer, const Batch& batch,
                                  const LossFn& loss, std::optional<c10::ScalarType> autocast, GradScaler* scaler) {
  clearGradients(*model);
  auto value = forwardLoss(*model, batch.inputs, batch.targets, loss, autocast);
  backwardAndStep(value, *model, optimizer, scaler);
  return value;
}

void LocalStrategy::attach(torch::nn::Sequential model, torch::optim::Optimizer& optimizer) {
  model_ = std::move(model);
  optimizer_ = &optimizer;
}

StepStats LocalStrategy::step(const Batch& batch, const LossFn& loss) {
  COHORT_CHECK(optimizer_ != nullptr, Error, "LocalStrategy::step before attach");
  const auto start = std::chrono::steady_clock::now();
  auto value = forwardBackwardStep(model_, *optimizer_, batch, loss, autocast(), scaler());
  StepStats stats;
  stats.loss = value.item<double>();
  stats.samples = batch.size();
  stats.computeSeconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return stats;
}

}  // namespace cohort
