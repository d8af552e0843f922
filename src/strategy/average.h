// Synchronous parameter averaging (local SGD; DL4J's ParameterAveraging): every worker steps its
// own optimizer on its own batches, and every `period` steps the parameters (and buffers, and on
// request the optimizer's state: momentum buffers, Adam's moments) are averaged over the workers.
// With period 1 and plain SGD this equals single-process training on the combined batch.
//
// With a codec (--codec), what travels is each worker's parameter change since the last average
// (the replicas all hold the same parameters then): the changes are summed through the codec
// (strategy/compressed.h; the encoder keeps what it did not send as its residual), and every
// replica sets its parameters to the last average plus the mean change. Buffers (BatchNorm's
// statistics) and optimizer state are averaged uncompressed, as without a codec.
#pragma once

#include <cohort/communicator.h>
#include <cohort/strategy.h>

#include "strategy/compressed.h"

#include <memory>

namespace cohort {

struct AverageOptions {
  int64_t period = 1;
  bool averageOptimizerState = false;
  compress::CodecSpec codec;
  int64_t codecWarmupSteps = 0;
};

class AverageStrategy final : public Strategy {
 public:
  AverageStrategy(std::shared_ptr<Communicator> comm, AverageOptions options);

  std::string name() const override { return "average"; }
  ReplicaInfo replica() const override;
  void attach(torch::nn::Sequential model, torch::optim::Optimizer& optimizer) override;
  StepStats step(const Batch& batch, const LossFn& loss) override;
  // Averages now if any step has been taken since the last average (every rank must call it).
  void synchronize() override;

 private:
  double average();  // returns the seconds spent in the allreduce
  void averageChanges();  // the parameters through the codec

  std::shared_ptr<Communicator> comm_;
  AverageOptions options_;
  torch::nn::Sequential model_{nullptr};
  torch::optim::Optimizer* optimizer_ = nullptr;
  int64_t sinceAverage_ = 0;
  int64_t steps_ = 0;
  std::unique_ptr<CompressedSum> compressed_;  // when a codec is set
  torch::Tensor anchor_;                       // the parameters after the last average, flat
  torch::Tensor delta_;                        // scratch: this replica's change, flat
  int64_t bytesSentAdjust_ = 0;      // the codec's byte count minus the communicator's, this step
  int64_t bytesReceivedAdjust_ = 0;
};

// The optimizer's per-parameter state tensors (momentum buffers; Adam's exp_avg and
// exp_avg_sq), in parameter order, so that all ranks list them alike.
std::vector<torch::Tensor> optimizerStateTensors(torch::optim::Optimizer& optimizer);

}  // namespace cohort
