// The single-process scheme: forward, backward, optimizer step, no exchange.
#pragma once

#include "schemes/model_sync.h"
#include "strategy/strategy.h"

namespace cohort {

class LocalStrategy final : public Strategy {
 public:
  Scheme scheme() const override { return Scheme::kLocal; }
  bool trainsOnDevices() const override { return true; }
  ReplicaInfo replica() const override { return {}; }
  void attach(torch::nn::Sequential model, torch::optim::Optimizer& optimizer) override;
  StepStats step(const Batch& batch, const LossFn& loss) override;
  void synchronize() override {}

 private:
  torch::nn::Sequential model_{nullptr};
  torch::optim::Optimizer* optimizer_ = nullptr;
};

// One step with no exchange: clear gradients, forward and loss (under `autocast` when set, see
// forwardLoss), backward, optimizer step (through `scaler` when there is one: scaledBackward, stepUnlessOverflow).
// Returns the loss.
torch::Tensor forwardBackwardStep(torch::nn::Sequential& model, torch::optim::Optimizer& optimizer, const Batch& batch,
                                  const LossFn& loss, std::optional<c10::ScalarType> autocast,
                                  GradScaler* scaler = nullptr);

}  // namespace cohort
