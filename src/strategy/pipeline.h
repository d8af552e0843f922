// Model parallelism: a sequential model cut into S stages, one per process, with micro-batches
// flowing through them (GPipe, 1F1B), and R replicas of that pipeline trained data-parallel.
//
// Ranks: rank = replica * S + stage. Stage s of replica q talks point to point with ranks
// rank-1 (activations in, gradients out) and rank+1 (activations out, gradients in) over the
// job's Gloo group; the stage's R copies average their gradients in a group of their own
// (ranks s, s+S, s+2S, ...) before each optimizer step. All stages of one replica read the same
// batches (the data is sharded by replica); stage 0 uses the inputs, the last stage the labels.
//
// The chief is rank 0, stage 0 of replica 0: the last stage sends it the loss of every step, and
// evaluation runs through replica 0's stages with the outputs sent back to it. Each stage of
// replica 0 writes its own checkpoints (--checkpoint-dir/stage-K); `pipeline.manifest` there
// records the stages and the cut, and a resume with another cut is refused.
//
// Shapes on the wire are known without headers: a dry run at attach time records every layer's
// output shape for a batch of 2, and the model may only be cut where an output's first dimension
// is the batch; a micro-batch of m examples then has shape [m, rest...].
//
// Devices: each stage's layers are on its process's device (--device cuda: cuda:LOCAL_RANK mod
// the GPU count, so on one GPU every stage shares cuda:0), and a step runs where its batch is.
// Gloo's messages are host memory: on a GPU, activations and gradients are copied to pinned host
// memory before a send and back to the device without blocking after a receive. The cut and
// --micro-batches auto are chosen before the model moves, from timings on the CPU.
#pragma once

#include <cohort/communicator.h>
#include "strategy/strategy.h"

#include "strategy/pipeline_plan.h"

#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace cohort {

class PipelineStrategy final : public Strategy {
 public:
  using Options = StrategyOptions::Pipeline;

  // Throws InvalidArgument when the options do not fit the job (stages x replicas processes).
  PipelineStrategy(std::shared_ptr<Communicator> comm, Options options, std::string checkpointDir, bool resume);

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

  const std::vector<int>& cut() const { return counts_; }
  const std::vector<int>& splits() const { return splits_; }

 private:
  // Sets counts_ and splits_ (rank 0 decides, everyone gets its choice). channels[j]: layer j's
  // output channels when a cut may split it (0: not splittable).
  void chooseCut(torch::nn::Sequential& model, const Batch& sample, const std::vector<bool>& cutAfter,
                 const std::vector<int64_t>& channels);
  std::vector<double> timeLayers(torch::nn::Sequential& model, const torch::Tensor& inputs);
  // The median round trip of a small message between ranks 0 and 1 (0 on other ranks, or with
  // one stage): the fixed cost of one micro-batch's messages. Ranks 0 and 1 call it together.
  double probeMessages();
  MicroBatchChoice chooseMicroBatchCount(torch::nn::Sequential& model, const Batch& sample,
                                         const std::vector<bool>& cutAfter, const std::vector<int>& counts,
                                         double messageSeconds);
  void printCut(const std::vector<double>& costs, const std::vector<int>& counts, const std::vector<int>& splits = {},
                const std::vector<int64_t>& channels = {}) const;
  torch::Tensor forwardCounting(const torch::Tensor& x, int64_t* bytes);
  int prevRank() const { return comm_->rank() - 1; }
  int nextRank() const { return comm_->rank() + 1; }
  bool first() const { return stage_ == 0; }
  bool last() const { return stage_ == options_.stages - 1; }

  // One step's time, by where it went (seconds).
  struct StepTimes {
    double forward = 0;   // this stage's layers (and the loss, on the last stage)
    double backward = 0;
    double idle = 0;      // blocked on a neighbour's activation or gradient
    double send = 0;      // posting sends
    double sendWait = 0;  // waiting for the sends to finish, at the end of the step
    double optimizer = 0;
  };

  std::shared_ptr<Communicator> comm_;
  std::shared_ptr<Communicator> stageGroup_;  // this stage in every replica
  Options options_;
  PipeSchedule schedule_;
  std::string checkpointDir_;
  bool resume_ = false;
  int stage_ = 0;
  int replica_ = 0;

  std::vector<int> counts_;  // layers per stage (a split layer counts in the later stage)
  // Per stage: output channels of the next stage's first layer that this stage computes (0: the
  // stages meet between layers; the last stage's is 0). See SplitHead in pipeline.cpp.
  std::vector<int> splits_;
  std::optional<MicroBatchChoice> autoChoice_;  // --micro-batches auto, on rank 0
  std::vector<std::string> layerNames_;
  std::vector<int64_t> inShape_;   // one example's input to this stage (stages > 0)
  std::vector<int64_t> outShape_;  // one example's output of this stage
  std::vector<int64_t> modelOutShape_;  // one example's output of the whole model
  c10::ScalarType inType_ = c10::kFloat;
  c10::ScalarType outType_ = c10::kFloat;
  c10::ScalarType modelOutType_ = c10::kFloat;

  torch::nn::Sequential model_{nullptr};  // this stage's layers
  torch::optim::Optimizer* optimizer_ = nullptr;
  CommWork lossSend_;
  // Receive buffers kept from step to step, as many as micro-batches can be in flight plus one
  // (stages > 0: activations in; stages < S-1: gradients in). See step().
  std::vector<torch::Tensor> activationBuffers_;
  std::vector<torch::Tensor> gradientBuffers_;

  // Measured over the steps after the first few, for the report.
  int64_t steps_ = 0;
  int64_t peakActivationBytes_ = 0;
  double idleSeconds_ = 0;
  double stepSeconds_ = 0;
  StepTimes steadyTimes_;
  std::vector<double> gathered_;  // every stage's kGathered values (pipeline.cpp), after finish()
};

// Layers [first, first + count) of `model`, the same module objects under the same names.
torch::nn::Sequential sliceModel(const torch::nn::Sequential& model, int first, int count);

}  // namespace cohort
