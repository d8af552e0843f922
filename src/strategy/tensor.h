// `--strategy tensor --ways W`: the CLI's adapter over the library's TensorParallel handle
// (include/cohort/tensor_parallel.h, src/schemes/tensor_parallel.cpp). W x R processes (cohort
// launch -n W*R): rank = replica * W + way; the ways of a replica read the same batches, each way
// averages its gradients with its copies in the other replicas (DataParallel over their group).
// Each way of replica 0 checkpoints its part under --checkpoint-dir/way-K.
#pragma once

#include <cohort/communicator.h>
#include <cohort/data_parallel.h>
#include <cohort/tensor_parallel.h>

#include "strategy/strategy.h"

#include <memory>

namespace cohort {

class TensorStrategy final : public Strategy {
 public:
  // Throws InvalidArgument when the job's size is not a multiple of the ways.
  TensorStrategy(std::shared_ptr<Communicator> comm, int ways);
  ~TensorStrategy() override;

  Scheme scheme() const override { return Scheme::kTensor; }
  bool trainsOnDevices() const override { return true; }
  std::shared_ptr<Communicator> communicator() const override { return comm_; }
  ReplicaInfo replica() const override { return {comm_->rank(), comm_->worldSize()}; }

  torch::nn::Sequential localModel(torch::nn::Sequential model, const Batch& sample) override;
  DataShard dataShard() const override { return {replica_, replicas_}; }
  CheckpointPlan checkpointPlan() const override;
  std::string layout() const override;
  bool joinsEvaluation() const override { return replica_ == 0; }

  void attach(torch::nn::Sequential model, torch::optim::Optimizer& optimizer) override;
  StepStats step(const Batch& batch, const LossFn& loss) override;
  void synchronize() override;
  MetricFields report() override;

 private:
  std::shared_ptr<Communicator> comm_;
  int ways_ = 1;
  int way_ = 0;
  int replica_ = 0;
  int replicas_ = 1;
  std::unique_ptr<TensorParallel> tp_;
  std::unique_ptr<DataParallel> dp_;  // with replicas
  torch::nn::Sequential model_{nullptr};
  torch::optim::Optimizer* optimizer_ = nullptr;
};

}  // namespace cohort
