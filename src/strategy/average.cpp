#include "strategy/average.h"

#include <cohort/error.h>

#include "strategy/local.h"

#include <torch/torch.h>

#include <chrono>
#include <cstdio>

namespace cohort {

AverageStrategy::AverageStrategy(std::shared_ptr<Communicator> comm, AveragingOptions options)
    : comm_(std::move(comm)), options_(std::move(options)) {
  COHORT_CHECK(comm_ != nullptr, InvalidArgument, "--strategy average needs a cluster");
  COHORT_CHECK(options_.period >= 1, InvalidArgument, "--period must be at least 1, got ", options_.period);
  COHORT_CHECK(options_.outerLr > 0, InvalidArgument, "--outer-lr must be positive, got ", options_.outerLr);
  COHORT_CHECK(options_.outerMomentum >= 0 && options_.outerMomentum < 1, InvalidArgument,
               "--outer-momentum must be in [0, 1), got ", options_.outerMomentum);
}

ReplicaInfo AverageStrategy::replica() const { return {comm_->rank(), comm_->worldSize()}; }

void AverageStrategy::attach(torch::nn::Sequential model, torch::optim::Optimizer& optimizer) {
  model_ = std::move(model);
  optimizer_ = &optimizer;
  averaging_ = std::make_unique<ParameterAveraging>(Job::fromCommunicator(comm_), *model_, optimizer_, options_);
}

StepStats AverageStrategy::step(const Batch& batch, const LossFn& loss) {
  COHORT_CHECK(averaging_ != nullptr, Error, "AverageStrategy::step before attach");
  const auto start = std::chrono::steady_clock::now();
  const AveragingStats before = averaging_->stats();
  auto value = forwardBackwardStep(model_, *optimizer_, batch, loss);
  averaging_->step();
  const AveragingStats after = averaging_->stats();
  StepStats stats;
  stats.loss = value.item<double>();
  stats.samples = batch.size() * comm_->worldSize();
  stats.bytesSent = after.bytesSent - before.bytesSent;
  stats.bytesReceived = after.bytesReceived - before.bytesReceived;
  stats.commWaitSeconds = after.commWaitSeconds - before.commWaitSeconds;
  stats.computeSeconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() - stats.commWaitSeconds;
  return stats;
}

void AverageStrategy::synchronize() {
  if (averaging_) averaging_->synchronize();
}

void AverageStrategy::saveState(torch::serialize::OutputArchive& archive) {
  if (!averaging_) return;
  if (torch::Tensor momentum = averaging_->outerMomentum(); momentum.defined()) archive.write("outer_momentum", momentum);
}

void AverageStrategy::loadState(torch::serialize::InputArchive& archive) {
  COHORT_CHECK(averaging_ != nullptr, Error, "AverageStrategy::loadState before attach");
  torch::Tensor momentum;
  if (archive.try_read("outer_momentum", momentum)) {
    averaging_->setOuterMomentum(momentum);
  } else if (averaging_->outerMomentum().defined()) {
    std::fprintf(stderr, "cohort: warning: the checkpoint holds no outer momentum (written without an outer "
                         "optimizer, or by an older cohort); the outer optimizer starts from zero momentum\n");
  }
}

}  // namespace cohort
