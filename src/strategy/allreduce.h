// `--strategy allreduce`: the CLI's adapter over the library's DataParallel handle
// (include/cohort/data_parallel.h, src/schemes/data_parallel.cpp), which does the work: bucketed
// gradient allreduce launched from autograd hooks, overlapping backward, with any codec.
#pragma once

#include <cohort/communicator.h>
#include <cohort/data_parallel.h>

#include "strategy/strategy.h"

#include <memory>
#include <vector>

namespace cohort {

class AllreduceStrategy final : public Strategy {
 public:
  AllreduceStrategy(std::shared_ptr<Communicator> comm, DataParallelOptions options);
  ~AllreduceStrategy() override;

  Scheme scheme() const override { return Scheme::kAllreduce; }
  bool trainsOnDevices() const override { return true; }
  std::shared_ptr<Communicator> communicator() const override { return comm_; }
  ReplicaInfo replica() const override;
  void attach(torch::nn::Sequential model, torch::optim::Optimizer& optimizer) override;
  StepStats step(const Batch& batch, const LossFn& loss) override;
  // Averages floating-point buffers (e.g. BatchNorm's running statistics), which each rank
  // updates from its own shard; parameters are identical already. Every rank must call it.
  void synchronize() override;
  // Every rank holds the same parameters and buffers after synchronize(): each scores a slice.
  std::shared_ptr<Communicator> evaluationGroup() const override { return comm_; }
  // The done event's "backend": what carried the gradients, "nccl" or "gloo".
  MetricFields report() override;
  // The codec's state ("allreduce_steps", the warm-up's count, and "allreduce_codec_residuals",
  // every rank's error feedback, gathered by prepareCheckpoint()): a resumed run goes on where
  // the checkpoint's left off, residuals included.
  void prepareCheckpoint() override;
  void saveState(torch::serialize::OutputArchive& archive) override;
  void loadState(torch::serialize::InputArchive& archive) override;

  size_t bucketCount() const { return dp_ ? dp_->stats().buckets : 0; }

 private:
  std::shared_ptr<Communicator> comm_;
  DataParallelOptions options_;
  torch::nn::Sequential model_{nullptr};
  torch::optim::Optimizer* optimizer_ = nullptr;
  std::unique_ptr<DataParallel> dp_;
  std::vector<torch::Tensor> residuals_;  // every rank's codec residual, from prepareCheckpoint()
};

}  // namespace cohort
