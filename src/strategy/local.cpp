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

void scaledBackward(const torch::Tensor& loss, GradScaler* scaler) {
  if (scaler == nullptr) {
    loss.backward();
  } else {
    scaler->scale(loss).backward();
  }
}

void stepUnlessOverflow(torch::nn::Module& model, torch::optim::Optimizer& optimizer, GradScaler* scaler) {
  if (scaler == nullptr || scaler->unscale(model.parameters())) optimizer.step();
}

torch::Tensor forwardBackwardStep(torch::nn::Sequential& model, torch::optim::Optimizer& optimizer, const Batch& batch,
                                  const LossFn& loss, std::optional<c10::ScalarType> autocast, GradScaler* scaler) {
  clearGradients(*model);
  auto value = forwardLoss(*model, batch.inputs, batch.targets, loss, autocast);
  scaledBackward(value, scaler);
  stepUnlessOverflow(*model, optimizer, scaler);
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
