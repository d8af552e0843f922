// `--strategy pipeline --stages S --replicas R`: the CLI's adapter over the library's Pipeline
// handle (include/cohort/pipeline.h, src/schemes/pipeline*.cpp). S x R processes (cohort launch
// -n S*R): rank = replica * S + stage; all stages of one replica read the same batches (the data
// is sharded by replica).
//
// The chief is rank 0, stage 0 of replica 0: the last stage sends it the loss of every step, and
// evaluation runs through replica 0's stages with the outputs sent back to it. Each stage of
// replica 0 writes its own checkpoints (--checkpoint-dir/stage-K); `pipeline.manifest` there
// records the stages and the cut, and a resume with another cut is refused.
//
// Devices: each stage's layers are on its process's device (--device cuda: cuda:LOCAL_RANK mod
// the GPU count, so on one GPU every stage shares cuda:0). The cut and --micro-batches auto are
// chosen before the model moves, from timings on the CPU.
#pragma once

#include <cohort/communicator.h>
#include <cohort/pipeline.h>

#include "strategy/strategy.h"

#include <memory>
#include <string>
#include <vector>

namespace cohort {

class PipelineStrategy final : public Strategy {
 public:
  using Options = StrategyOptions::Pipeline;

  // Throws InvalidArgument when the options do not fit the job (stages x replicas processes).
  PipelineStrategy(std::shared_ptr<Communicator> comm, Options options, std::string checkpointDir, bool resume);
  ~PipelineStrategy() override;

  Scheme scheme() const override { return Scheme::kPipeline; }
  bool trainsOnDevices() const override { return true; }
  std::shared_ptr<Communicator> communicator() const override { return comm_; }
  ReplicaInfo replica() const override { return {comm_->rank(), comm_->worldSize()}; }

  torch::nn::Sequential localModel(torch::nn::Sequential model, const Batch& sample) override;
  DataShard dataShard() const override { return {replica_, options_.replicas}; }
  CheckpointPlan checkpointPlan() const override;
  std::string layout() const override;
  bool joinsEvaluation() const override { return replica_ == 0; }
  torch::Tensor infer(torch::nn::Sequential& model, const torch::Tensor& inputs) override;

  void attach(torch::nn::Sequential model, torch::optim::Optimizer& optimizer) override;
  StepStats step(const Batch& batch, const LossFn& loss) override;
  void synchronize() override;
  void finish() override;
  MetricFields report() override;

 private:
  std::shared_ptr<Communicator> comm_;
  Options options_;
  std::string checkpointDir_;
  bool resume_ = false;
  int stage_ = 0;
  int replica_ = 0;
  std::unique_ptr<Pipeline> pipeline_;  // made by localModel
  torch::optim::Optimizer* optimizer_ = nullptr;
  PipelineSummary summary_;  // after finish()
};

}  // namespace cohort
