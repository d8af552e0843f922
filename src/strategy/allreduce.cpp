#include "strategy/allreduce.h"

#include <cohort/error.h>

#include "schemes/model_sync.h"
#include "strategy/codec_state.h"

#include <torch/torch.h>

#include <chrono>

namespace cohort {

namespace {

// Not average's keys: its residual is laid out over the parameters, this one over the buckets.
constexpr CodecStateKeys kAllreduceCodecKeys{.steps = "allreduce_steps", .residuals = "allreduce_codec_residuals"};

}  // namespace

AllreduceStrategy::AllreduceStrategy(std::shared_ptr<Communicator> comm, DataParallelOptions options)
    : comm_(std::move(comm)), options_(std::move(options)) {
  COHORT_CHECK(comm_ != nullptr, InvalidArgument, "--strategy allreduce needs a cluster");
  COHORT_CHECK(options_.bucketMb > 0, InvalidArgument, "--bucket-mb must be positive, got ", options_.bucketMb);
  COHORT_CHECK(options_.firstBucketMb > 0, InvalidArgument, "--first-bucket-mb must be positive, got ",
               options_.firstBucketMb);
}

AllreduceStrategy::~AllreduceStrategy() = default;

ReplicaInfo AllreduceStrategy::replica() const { return {comm_->rank(), comm_->worldSize()}; }

void AllreduceStrategy::attach(torch::nn::Sequential model, torch::optim::Optimizer& optimizer) {
  model_ = std::move(model);
  optimizer_ = &optimizer;
  dp_ = std::make_unique<DataParallel>(Job::fromCommunicator(comm_), *model_, options_);
}

void AllreduceStrategy::synchronize() {
  if (dp_) dp_->synchronizeBuffers();
}

void AllreduceStrategy::prepareCheckpoint() {
  if (!dp_) return;
  // Every rank keeps a residual of its own; the chief writes the checkpoint alone.
  if (torch::Tensor residual = dp_->codecState().residual; residual.defined()) residuals_ = comm_->allgather(residual);
}

void AllreduceStrategy::saveState(torch::serialize::OutputArchive& archive) {
  if (!dp_) return;
  writeCodecState(archive, kAllreduceCodecKeys, dp_->codecState().steps, residuals_);
  residuals_.clear();
}

void AllreduceStrategy::loadState(torch::serialize::InputArchive& archive) {
  COHORT_CHECK(dp_ != nullptr, Error, "AllreduceStrategy::loadState before attach");
  const std::optional<SavedCodecState> saved =
      readCodecState(archive, kAllreduceCodecKeys, comm_->rank(), comm_->worldSize(), options_.codec,
                     dp_->codecState().residual.defined());
  if (saved) dp_->setCodecState({.steps = saved->steps, .residual = saved->residual});
}

MetricFields AllreduceStrategy::report() {
  // kAuto: no collective over CUDA tensors ran (a model on the CPU): Gloo carried everything.
  const CommBackend used = comm_->cudaBackend();
  return {{"backend", commBackendName(used == CommBackend::kNccl ? CommBackend::kNccl : CommBackend::kGloo)}};
}

StepStats AllreduceStrategy::step(const Batch& batch, const LossFn& loss) {
  COHORT_CHECK(dp_ != nullptr, Error, "AllreduceStrategy::step before attach");
  const auto start = std::chrono::steady_clock::now();
  const DataParallelStats before = dp_->stats();
  // Dropping the gradients (rather than zero-filling them) saves the hooks an addition.
  clearGradients(*model_);
  auto value = forwardLoss(*model_, batch.inputs, batch.targets, loss, autocast());
  const auto forwardEnd = std::chrono::steady_clock::now();
  // Under --autocast fp16 the scaled loss: the buckets average scaled gradients, and every rank
  // unscales the same averages, so all skip the same steps.
  scaledBackward(value, scaler());
  const auto backwardEnd = std::chrono::steady_clock::now();
  stepUnlessOverflow(*model_, *optimizer_, scaler());
  const DataParallelStats after = dp_->stats();

  StepStats stats;
  stats.loss = value.item<double>();
  stats.samples = batch.size() * comm_->worldSize();
  stats.bytesSent = after.bytesSent - before.bytesSent;
  stats.bytesReceived = after.bytesReceived - before.bytesReceived;
  stats.commWaitSeconds = after.commWaitSeconds - before.commWaitSeconds;
  stats.computeSeconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() - stats.commWaitSeconds;
  // Where the step went: backward_s includes the end-of-backward wait (comm_wait_s); encode_s,
  // wire_s and decode_s are the codec's communication thread, which overlaps backward.
  auto seconds = [](auto from, auto to) { return std::chrono::duration<double>(to - from).count(); };
  stats.extra = {{"forward_s", seconds(start, forwardEnd)},
                 {"backward_s", seconds(forwardEnd, backwardEnd)},
                 {"encode_s", after.encodeSeconds - before.encodeSeconds},
                 {"wire_s", after.wireSeconds - before.wireSeconds},
                 {"decode_s", after.decodeSeconds - before.decodeSeconds},
                 {"buckets_in_backward", after.bucketsStartedInBackward - before.bucketsStartedInBackward}};
  return stats;
}

}  // namespace cohort
