#include "strategy/tensor.h"

#include <cohort/error.h>

#include "schemes/model_sync.h"

#include <torch/torch.h>

#include <chrono>

namespace cohort {

TensorStrategy::TensorStrategy(std::shared_ptr<Communicator> comm, int ways) : comm_(std::move(comm)), ways_(ways) {
  COHORT_CHECK(ways_ >= 1, InvalidArgument, "--ways must be at least 1, got ", ways_);
  // One process has no communicator (Job::communicator()): nothing to split the layers over.
  COHORT_CHECK(comm_ != nullptr || ways_ > 1, InvalidArgument, "--strategy tensor --ways ", ways_,
               " is one process, which has no other way to split the layers with: use --strategy local, or "
               "launch ways x replicas processes (cohort launch -n 2 ... --ways 2)");
  COHORT_CHECK(comm_ != nullptr && comm_->worldSize() % ways_ == 0, InvalidArgument, "--strategy tensor --ways ",
               ways_, " needs a multiple of ", ways_, " processes (cohort launch -n ", ways_,
               " or ways x replicas), but this job has ", comm_ ? comm_->worldSize() : 1);
  way_ = comm_->rank() % ways_;
  replica_ = comm_->rank() / ways_;
  replicas_ = comm_->worldSize() / ways_;
  const int W = ways_, R = replicas_;
  comm_->setRankNames([W, R](int rank) {
    std::string name = "rank " + std::to_string(rank) + " (way " + std::to_string(rank % W);
    if (R > 1) name += " of replica " + std::to_string(rank / W);
    return name + ")";
  });
}

TensorStrategy::~TensorStrategy() = default;

torch::nn::Sequential TensorStrategy::localModel(torch::nn::Sequential model, const Batch& sample) {
  tp_ = std::make_unique<TensorParallel>(Job::fromCommunicator(comm_), model, sample.inputs,
                                         TensorParallelOptions{.ways = ways_});
  return tp_->module();
}

CheckpointPlan TensorStrategy::checkpointPlan() const {
  return {.writes = replica_ == 0, .subdir = "way-" + std::to_string(way_), .group = tp_->dataJob().communicator()};
}

std::string TensorStrategy::layout() const {
  return "ways=" + std::to_string(ways_) + " way=" + std::to_string(way_);
}

void TensorStrategy::attach(torch::nn::Sequential model, torch::optim::Optimizer& optimizer) {
  model_ = std::move(model);
  optimizer_ = &optimizer;
  if (replicas_ > 1) {
    dp_ = std::make_unique<DataParallel>(tp_->dataJob(), *model_,
                                         DataParallelOptions{.buffers = DataParallelOptions::Buffers::kOnRequest});
  }
}

StepStats TensorStrategy::step(const Batch& batch, const LossFn& loss) {
  COHORT_CHECK(model_, Error, "TensorStrategy::step before attach");
  const auto start = std::chrono::steady_clock::now();
  // The split groups share the job communicator's counters: these are all of this process's bytes.
  const CommCounters before = comm_->counters();
  clearGradients(*model_);
  auto value = forwardLoss(*model_, batch.inputs, batch.targets, loss, autocast());
  value.backward();
  optimizer_->step();
  const CommCounters after = comm_->counters();
  StepStats stats;
  stats.loss = value.item<double>();
  stats.samples = batch.size() * replicas_;
  stats.bytesSent = after.bytesSent - before.bytesSent;
  stats.bytesReceived = after.bytesReceived - before.bytesReceived;
  stats.commWaitSeconds = after.waitSeconds - before.waitSeconds;
  stats.computeSeconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() - stats.commWaitSeconds;
  return stats;
}

void TensorStrategy::synchronize() {
  if (dp_) dp_->synchronizeBuffers();
}

MetricFields TensorStrategy::report() {
  int64_t parameters = 0;
  for (const auto& p : model_->parameters()) parameters += p.numel();
  return {{"ways", int64_t(ways_)},
          {"tensor_plan", tp_->plan()},
          {"parameters_per_process", parameters}};
}

}  // namespace cohort
