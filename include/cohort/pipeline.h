// Model parallelism by layers (GPipe; PipeDream-flush's 1F1B): a torch::nn::Sequential cut into S
// stages, one per process, with the batch's micro-batches flowing through them, and R copies of
// that pipeline trained data-parallel.
//
//   auto job = cohort::Job::fromEnvironment();                    // S x R processes
//   cohort::Pipeline pipe(job, net, sampleInputs, {.stages = 2, .microBatches = 4});
//   torch::optim::SGD opt(pipe.module()->parameters(), 0.1);      // this stage's layers
//   auto loss = [](const torch::Tensor& out, const torch::Tensor& y) { return torch::nll_loss(out, y); };
//   for (auto& batch : batches) {                                 // the same batches on every stage
//     auto stats = pipe.step(batch.data, batch.target, loss, opt);
//   }
//
// Ranks: rank = replica * S + stage. Stage s of replica q exchanges activations and gradients
// point to point with ranks rank-1 and rank+1; the R copies of a stage average their gradients
// before each optimizer step. Every stage of one replica must step on the same batches (stage 0
// reads the inputs, the last stage the targets): a stage given another batch size than the
// stage before it throws InvalidArgument naming both (each stage sends its size ahead of its
// activations), and the stages waiting on it then fail with a CommError naming it. step() and
// infer() are collectives of the replica's stages, the constructor, step() and finish() of the
// whole job: every process calls them in the same order.
//
// The cut: where the model may be cut is learned from a dry run on two examples of `sample` (a
// layer whose output's first dimension is the batch); where it is cut, from `partition`, or from
// each layer's forward+backward timed on rank 0 (every process takes rank 0's choice). A cut may
// split a Conv2d or a Linear by output channels between two stages ("L+C", or "split").
//
// Devices: move module() to this process's device after construction; a step runs where its
// batch is. Messages go through the job's Gloo group in host memory (pinned on a GPU). Every wait
// is bounded by the job's timeout. Errors are cohort::Error subclasses.
#pragma once

#include <cohort/export.h>

#include <cohort/job.h>

#include <c10/core/ScalarType.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace cohort {

// The order of a stage's forward and backward passes over the micro-batches.
//   kGpipe: every forward, then every backward: M micro-batches' activations held at the peak.
//   kOneFOneB: after S-1-s forwards, one forward and one backward in turn: at most S-s held.
enum class PipeSchedule { kGpipe, kOneFOneB };

// PipelineOptions::microBatches: chosen at construction from timings on rank 0.
constexpr int kAutoMicroBatches = 0;

// Where the model is cut into stages: balanced by each layer's measured cost (kAuto), the same
// with a stage allowed to end inside a Conv2d or Linear, taking its first output channels (kSplit),
// or given (kLayers). Made from the command line's text, implicitly, so that
// `.partition = "3,3"` reads as `--partition 3,3` does.
struct COHORT_API PipelinePartition {
  enum class Kind { kAuto, kSplit, kLayers };
  Kind kind = Kind::kAuto;
  std::vector<int> layers;    // kLayers: layers per stage, each positive
  std::vector<int> channels;  // kLayers: per stage, the first C output channels of the next stage's
                              // first layer it also computes ("L+C"; 0: none); the last is 0

  PipelinePartition() = default;
  // "auto", "split", or "L1,L2,..." with each item L or L+C. Throws InvalidArgument naming what
  // is wrong; how many stages and layers it must cover is checked against the model.
  PipelinePartition(const char* text);         // NOLINT(google-explicit-constructor)
  PipelinePartition(const std::string& text);  // NOLINT(google-explicit-constructor)
  // The text it was made from, canonical: PipelinePartition(p.text()) == p.
  std::string text() const;
  // kSplit, or a given cut that splits a layer (some C > 0).
  bool splitsALayer() const;
  bool operator==(const PipelinePartition&) const = default;
};

struct COHORT_API PipelineOptions {
  int stages = 0;        // 0: every process of the job
  int replicas = 0;      // copies of the pipeline; 0: the job's processes / stages
  int microBatches = 4;  // per batch (a batch smaller than that runs one example per micro-batch)
  PipeSchedule schedule = PipeSchedule::kOneFOneB;
  PipelinePartition partition;  // auto
  // Where the stages' checkpoints are kept: rank 0 writes `pipeline.manifest` there (the stages
  // and the cut); with `resume`, the cut is read from it and another is refused. Without
  // `resume`, a directory that already holds stage checkpoints (stage-K/) keeps its manifest: an
  // earlier run's, which its resume needs (the Trainer refuses such a run).
  std::string checkpointDir;
  bool resume = false;
  // Mixed precision (cohort::Autocast): each stage's layers and the loss run under autocast in
  // this dtype (bfloat16 only: float16 would need loss scaling inside step()); what crosses between stages keeps the
  // dtype the dry run found (float32 for a float32 model), an activation autocast made 16-bit cast back after the
  // stage's last layer. std::nullopt: none.
  std::optional<c10::ScalarType> autocast;
};

// The loss of a micro-batch's outputs against its targets, averaged over its examples.
using PipelineLoss = std::function<torch::Tensor(const torch::Tensor& output, const torch::Tensor& target)>;

// One step, as this process saw it (seconds, bytes).
struct COHORT_API PipelineStepStats {
  // The batch's loss: on the last stage, and on rank 0 (it is sent there); 0 elsewhere.
  double loss = 0;
  int microBatches = 0;
  int64_t peakActivationBytes = 0;  // this stage's inputs and outputs held at once
  double seconds = 0;
  double forwardSeconds = 0;  // this stage's layers (and the loss, on the last stage)
  double backwardSeconds = 0;
  double idleSeconds = 0;      // blocked on a neighbour's activation or gradient
  double sendSeconds = 0;      // posting sends
  double sendWaitSeconds = 0;  // waiting for the sends, at the end of the step
  double optimizerSeconds = 0;
  double waitSeconds = 0;  // every wait on another process (idle, sends, averaging, the loss)
  int64_t bytesSent = 0;
  int64_t bytesReceived = 0;
};

// What finish() gathered: replica 0's stages, over the steps after the first five.
struct COHORT_API PipelineSummary {
  std::vector<int64_t> stagePeakActivationBytes;
  std::vector<double> stageIdleFraction;  // of the step time
  std::vector<double> stageComputeFraction;
  std::vector<double> stageSendFraction;
  std::vector<double> stageOptimizerFraction;
  double bubbleFraction = 0;          // the mean idle fraction
  double bubbleFractionTheory = 0;    // (S-1)/(M+S-1)
  double bubbleFractionExpected = 0;  // the schedule's bubble for the measured stage times
  // microBatches == kAutoMicroBatches: the model it was chosen by (rank 0).
  bool microBatchesAuto = false;
  double microBatchFixedSeconds = 0;
  double microBatchWorkSeconds = 0;
  double predictedStepSeconds = 0;
};

class COHORT_API Pipeline {
 public:
  // `model` is the whole network, initialized alike on every process; `sample` a batch of inputs
  // as training will see them (shapes, timings; its size is the batch for kAutoMicroBatches). A
  // collective of the job. Throws InvalidArgument when the job is not stages x replicas processes,
  // the model has fewer layers than stages, or the partition does not fit the model (naming the
  // layer); with `resume`, when the manifest's stages or cut differ; with replicas > 1, when the
  // model has a sparse embedding table (the copies average dense gradients). A split layer's parts
  // require their gradients as the layer's weight and bias do (a frozen layer stays frozen).
  Pipeline(const Job& job, torch::nn::Sequential model, const torch::Tensor& sample, PipelineOptions options);
  ~Pipeline();
  Pipeline(const Pipeline&) = delete;
  Pipeline& operator=(const Pipeline&) = delete;

  // This stage's layers: the model's module objects under their names (a split layer's part is a
  // new module holding its rows of the weight and bias under the layer's name).
  torch::nn::Sequential module() const;
  int stages() const;
  int stage() const;
  int replica() const;
  int replicas() const;
  int microBatches() const;      // as chosen, when kAutoMicroBatches
  std::vector<int> cut() const;  // layers per stage (a split layer counts in the later stage)
  // Per stage: output channels of the next stage's first layer it computes (0: none).
  std::vector<int> splits() const;
  // This stage's copies in every replica (a job of one process with one replica).
  Job stageJob() const;

  // Makes every replica's copy of this stage hold replica 0's parameters and buffers (a
  // collective of the stage's copies; the constructor leaves them as they were made).
  void broadcastParameters();
  // One training step on this replica's batch: forward and backward of each micro-batch in the
  // schedule's order, the gradients averaged over the stage's copies, then `optimizer.step()`.
  // Frozen parameters take no part in the average; a trainable one that no copy got a gradient
  // for keeps none (the optimizer leaves it alone, as in one process). Throws InvalidArgument,
  // before any message, for an empty batch or targets of another size than the inputs.
  PipelineStepStats step(const torch::Tensor& inputs, const torch::Tensor& targets, const PipelineLoss& loss,
                         torch::optim::Optimizer& optimizer);
  // The whole model's outputs for `inputs`, through replica 0's stages (their collective, each
  // called with the same inputs); defined on rank 0 alone.
  torch::Tensor infer(const torch::Tensor& inputs);
  // Averages the buffers (BatchNorm's statistics) over the stage's copies; waits for the last loss
  // message. Call before evaluating or saving.
  void synchronizeBuffers();
  // After the last step, a collective of the job: every stage's figures, gathered everywhere.
  PipelineSummary finish();

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace cohort
