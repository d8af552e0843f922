#include "strategy/average.h"

#include <cohort/error.h>

#include "schemes/model_sync.h"
#include "strategy/codec_state.h"
#include "strategy/local.h"

#include <torch/torch.h>

#include <chrono>
#include <cstdio>

namespace cohort {

namespace {

constexpr CodecStateKeys kAverageCodecKeys{.steps = "average_steps", .residuals = "codec_residuals"};

}  // namespace

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
  auto value = forwardBackwardStep(model_, *optimizer_, batch, loss, autocast(), scaler());
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
  if (!averaging_) return;
  const AveragingStats before = averaging_->stats();
  averaging_->synchronize();
  const AveragingStats after = averaging_->stats();
  offStep_.bytesSent += after.bytesSent - before.bytesSent;
  offStep_.bytesReceived += after.bytesReceived - before.bytesReceived;
  offStep_.commWaitSeconds += after.commWaitSeconds - before.commWaitSeconds;
}

void AverageStrategy::saveState(torch::serialize::OutputArchive& archive) {
  if (!averaging_) return;
  if (torch::Tensor momentum = averaging_->outerMomentum(); momentum.defined()) archive.write("outer_momentum", momentum);
  writeCodecState(archive, kAverageCodecKeys, averaging_->codecState().steps, residuals_);
  if (!scalers_.empty()) archive.write("grad_scalers", torch::stack(scalers_));
  for (size_t r = 0; r < optimizers_.size(); ++r) archive.write("optimizer_state_" + std::to_string(r), optimizers_[r]);
  residuals_.clear();
  scalers_.clear();
  optimizers_.clear();
}

void AverageStrategy::prepareCheckpoint() {
  if (!averaging_) return;
  // Every rank keeps a residual of its own; the chief writes the checkpoint alone.
  if (torch::Tensor residual = averaging_->codecState().residual; residual.defined()) {
    residuals_ = comm_->allgather(residual);
  }
  if (const GradScaler* scaler = this->scaler()) scalers_ = comm_->allgather(scalerStateTensor(*scaler));
  // Each rank's optimizer (momentum, Adam's moments and steps) is its own between averages.
  std::string bytes = optimizerBytes(*optimizer_);
  optimizers_ =
      comm_->allgatherVariable(torch::from_blob(bytes.data(), {int64_t(bytes.size())}, torch::kUInt8).clone());
}

void AverageStrategy::loadState(torch::serialize::InputArchive& archive) {
  COHORT_CHECK(averaging_ != nullptr, Error, "AverageStrategy::loadState before attach");
  // This rank's own optimizer state, over the writer's that the Trainer restored (absent from
  // checkpoints of an earlier cohort: then every rank resumes with the writer's). The run's
  // learning rate and momentum, which the Trainer put back after its load, stay.
  if (torch::Tensor packed; archive.try_read("optimizer_state_" + std::to_string(comm_->rank()), packed)) {
    const torch::Tensor bytes = packed.to(torch::kCPU).contiguous();
    torch::serialize::InputArchive mine;
    mine.load_from(reinterpret_cast<const char*>(bytes.data_ptr<uint8_t>()), size_t(bytes.numel()),
                   model_->parameters().front().device());
    loadOptimizerKeepingOptions(*optimizer_, mine);
  }
  // This rank's own loss scaler, over the writer's that the Trainer restored.
  if (torch::Tensor scalers; scaler() != nullptr && archive.try_read("grad_scalers", scalers)) {
    if (scalers.dim() == 2 && scalers.size(0) == comm_->worldSize()) {
      scaler()->loadState(scalerStateFromTensor(scalers[comm_->rank()], "the checkpoint's grad_scalers"));
    } else {
      std::fprintf(stderr,
                   "cohort: warning: the checkpoint's loss scalers are of %lld ranks, this job has %d; every "
                   "rank resumes with the writer's\n",
                   scalers.dim() == 2 ? (long long)scalers.size(0) : -1LL, comm_->worldSize());
    }
  }
  torch::Tensor momentum;
  if (archive.try_read("outer_momentum", momentum)) {
    averaging_->setOuterMomentum(momentum);
  } else if (averaging_->outerMomentum().defined()) {
    std::fprintf(stderr, "cohort: warning: the checkpoint holds no outer momentum (written without an outer "
                         "optimizer, or by an older cohort); the outer optimizer starts from zero momentum\n");
  }
  // The codec's state: the steps taken (the warm-up's count) and this rank's residual.
  const std::optional<SavedCodecState> saved =
      readCodecState(archive, kAverageCodecKeys, comm_->rank(), comm_->worldSize(), options_.codec,
                     averaging_->codecState().residual.defined());
  if (saved) averaging_->setCodecState({.steps = saved->steps, .residual = saved->residual});
}

}  // namespace cohort
