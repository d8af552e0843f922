// `--strategy average`: the CLI's adapter over the library's ParameterAveraging handle
// (include/cohort/averaging.h, src/schemes/averaging.cpp).
#pragma once

#include <cohort/averaging.h>
#include <cohort/communicator.h>

#include "strategy/strategy.h"

#include <memory>

namespace cohort {

class AverageStrategy final : public Strategy {
 public:
  AverageStrategy(std::shared_ptr<Communicator> comm, AveragingOptions options);

  Scheme scheme() const override { return Scheme::kAverage; }
  // On a device the parameters are averaged through pinned host memory (ParameterAveraging).
  bool trainsOnDevices() const override { return true; }
  std::shared_ptr<Communicator> communicator() const override { return comm_; }
  ReplicaInfo replica() const override;
  void attach(torch::nn::Sequential model, torch::optim::Optimizer& optimizer) override;
  StepStats step(const Batch& batch, const LossFn& loss) override;
  // Averages now if any step has been taken since the last average (every rank must call it): an
  // evaluation or a checkpoint between averages averages early, and the period counts anew.
  void synchronize() override;
  // Every rank holds the same parameters and buffers after synchronize(): each scores a slice.
  std::shared_ptr<Communicator> evaluationGroup() const override { return comm_; }
  // The averages synchronize() ran: their bytes and waiting.
  StepStats offStepStats() const override { return offStep_; }
  // The outer optimizer's momentum ("outer_momentum"), when there is one; the steps taken
  // ("average_steps", which decide when --codec-warmup-steps ends) and the codec's residual
  // ("codec_residuals", every rank's error feedback, gathered by prepareCheckpoint()), when the
  // codec keeps one; under --autocast fp16, every rank's loss scaler ("grad_scalers": each rank
  // unscales its own gradients, so their scales part), gathered alike; and every rank's optimizer
  // state ("optimizer_state_R"), its own since the averages (the Trainer's checkpoint holds the
  // writer's only), gathered alike.
  void prepareCheckpoint() override;
  void saveState(torch::serialize::OutputArchive& archive) override;
  void loadState(torch::serialize::InputArchive& archive) override;

 private:
  std::shared_ptr<Communicator> comm_;
  AveragingOptions options_;
  torch::nn::Sequential model_{nullptr};
  torch::optim::Optimizer* optimizer_ = nullptr;
  std::unique_ptr<ParameterAveraging> averaging_;
  StepStats offStep_;                     // what synchronize() exchanged
  std::vector<torch::Tensor> residuals_;  // every rank's codec residual, from prepareCheckpoint()
  std::vector<torch::Tensor> scalers_;    // every rank's scalerStateTensor, from prepareCheckpoint()
  std::vector<torch::Tensor> optimizers_;  // every rank's serialized optimizer, from prepareCheckpoint()
};

}  // namespace cohort
