#include "strategy/local.h"

#include <cohort/autocast.h>
#include <cohort/error.h>

#include <torch/torch.h>

#include <chrono>
#include <cmath>
#include <string>

namespace cohort {

torch::Tensor forwardLoss(torch::nn::SequentialImpl& model, const torch::Tensor& inputs, const torch::Tensor& targets,
                          const LossFn& loss, std::optional<c10::ScalarType> autocast) {
  if (!autocast) return loss(model.forward(inputs), targets);
  Autocast scope(inputs.device().type(), *autocast);
  return loss(model.forward(inputs), targets);
}

torch::Tensor scalerStateTensor(const GradScaler& scaler) {
  const GradScalerState state = scaler.state();
  return torch::tensor({state.scale, double(state.growthTracker), double(state.skippedSteps)}, torch::kFloat64);
}

GradScalerState scalerStateFromTensor(const torch::Tensor& saved, const std::string& where) {
  COHORT_CHECK(saved.dim() == 1 && saved.numel() == 3, IoError, where, ": the loss scaler's state is ", saved.sizes(),
               ", not [3]");
  const torch::Tensor v = saved.to(torch::kCPU, torch::kFloat64).contiguous();
  const double* at = v.data_ptr<double>();
  for (int i = 1; i < 3; ++i) {
    COHORT_CHECK(at[i] >= 0 && at[i] <= 0x1p53 && at[i] == std::floor(at[i]), IoError, where,
                 ": the loss scaler's count ", at[i], " is not a count");
  }
  return {at[0], int64_t(at[1]), int64_t(at[2])};
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
