// A Strategy owns how one training step on this replica turns into new parameters: the forward
// and backward pass, and whatever exchange with other processes its scheme does. The Trainer owns
// everything else (data, epochs, evaluation, checkpoints, metrics).
#pragma once

#include <cohort/autocast.h>
#include <cohort/averaging.h>
#include <cohort/data.h>
#include <cohort/data_parallel.h>
#include <cohort/gossip.h>
#include <cohort/job.h>
#include <cohort/metrics.h>
#include <cohort/parameter_server.h>
#include <cohort/pipeline.h>
#include <cohort/replicas.h>

#include "base/scheme.h"

#include <torch/nn/modules/container/sequential.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/archive.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace cohort {

using LossFn = std::function<torch::Tensor(const torch::Tensor& output, const torch::Tensor& target)>;

// What one step did, as seen from this replica.
struct StepStats {
  double loss = 0.0;               // this replica's loss on its batch
  int64_t samples = 0;             // examples trained on by all replicas together in this step
  int64_t bytesSent = 0;           // payload bytes this replica sent
  int64_t bytesReceived = 0;       // payload bytes this replica received
  double computeSeconds = 0.0;     // forward + backward + optimizer
  double commWaitSeconds = 0.0;    // time blocked on communication (not hidden by overlap)
  MetricFields extra;              // scheme-specific fields for the step event (ps: staleness)
  bool stopJob = false;            // the chief stopped the job early (requestStop): end the loop
};

// Where this process stands in the job. The chief (rank 0) evaluates, logs and reports.
struct ReplicaInfo {
  int rank = 0;
  int worldSize = 1;
  bool isChief() const { return rank == 0; }
};

// The part of the training data a process reads: shard `index` of `count` (ShardSampler).
struct DataShard {
  int index = 0;
  int count = 1;
};

class Communicator;

// Who keeps checkpoints, and where.
struct CheckpointPlan {
  bool writes = false;  // this process reads and writes checkpoints
  // The scheme keeps the training state itself (ps: the shards checkpoint the parameters and the
  // workers' clocks): the Trainer writes and reads no checkpoints.
  bool keptByScheme = false;
  std::string subdir;   // under --checkpoint-dir; "" for the directory itself
  // The processes that restore from the same checkpoint; its rank 0 (a writer) reads it and sends
  // it to the others on --resume. Null: the job's communicator, if any.
  std::shared_ptr<Communicator> group;
};

class Strategy {
 public:
  virtual ~Strategy() = default;

  virtual Scheme scheme() const = 0;
  std::string name() const { return schemeName(scheme()); }
  virtual ReplicaInfo replica() const = 0;
  // Whether this scheme trains a model on a CUDA device (--device); the others train on the CPU.
  virtual bool trainsOnDevices() const { return false; }
  // The job's communicator when the scheme formed one (the Trainer broadcasts checkpoints and the
  // stop decision through it); null for ps, gossip and a single process.
  virtual std::shared_ptr<Communicator> communicator() const { return nullptr; }

  // The hooks below tell the Trainer how this scheme maps processes onto the model and the data;
  // the defaults are data parallelism's: every process holds the whole model, reads its own
  // shard, and the chief alone evaluates and checkpoints.

  // Once, before the optimizer is made: the layers this process trains (pipeline: its stage).
  // `sample` is a batch of training data (for shapes, and for timing layers).
  virtual torch::nn::Sequential localModel(torch::nn::Sequential model, const Batch& sample) { return model; }

  virtual DataShard dataShard() const { return {replica().rank, replica().worldSize}; }

  virtual CheckpointPlan checkpointPlan() const {
    CheckpointPlan plan;
    plan.writes = replica().isChief();
    return plan;
  }

  // Training state the scheme keeps beyond the model and the optimizer (average: the outer
  // optimizer's momentum). saveState() is called on the checkpoint's writer right after
  // synchronize(); on --resume, loadState() is called after attach() on every process that
  // restored the checkpoint, with what the writer saved (an empty archive for a checkpoint
  // written without it).
  virtual void saveState(torch::serialize::OutputArchive& archive) {}
  virtual void loadState(torch::serialize::InputArchive& archive) {}
  // Called on every process before each checkpoint, right after synchronize() (a collective where
  // the scheme needs one): state that differs between processes reaches the writer here (average:
  // every rank's codec residual), since saveState() runs on the writer alone.
  virtual void prepareCheckpoint() {}
  // On --resume, before attach(), on every process that restored a checkpoint: the step it holds
  // (gossip: each peer's step count, and its codec's warm-up, go on from there).
  virtual void resumeAt(int64_t step) {}

  // On --resume, for a scheme without a communicator whose processes all restore the writer's
  // checkpoint (gossip): sends `payload` (the writer's checkpoint; empty when it has none, and
  // on every other process) to every process, and returns the writer's there. Called on every
  // process before attach(). The default has no one to send to.
  virtual std::vector<uint8_t> shareCheckpoint(std::vector<uint8_t> payload) { return payload; }

  // What a checkpoint must agree on beyond the run's options (pipeline: the stage and the cut).
  virtual std::string layout() const { return ""; }

  // Whether this process takes part in evaluation; the chief always does.
  virtual bool joinsEvaluation() const { return replica().isChief() || evaluationGroup() != nullptr; }

  // The processes that hold the same model after synchronize() (allreduce, average: all of
  // communicator()), so that each scores a slice of the test and validation sets and the slices'
  // counts are summed to the whole sets' scores: evaluation takes 1/N of the time, and no process
  // waits at its next collective (bounded by --timeout) while the chief alone scores a large set.
  // Null where the chief scores alone.
  virtual std::shared_ptr<Communicator> evaluationGroup() const { return nullptr; }

  // Inference on the whole model for evaluation, called by every process that joins it, with the
  // same inputs; returns the outputs on the chief (others may get an undefined tensor).
  virtual torch::Tensor infer(torch::nn::Sequential& model, const torch::Tensor& inputs) {
    return model->forward(inputs);
  }

  // Once, before training: make every replica start from the same parameters.
  virtual void attach(torch::nn::Sequential model, torch::optim::Optimizer& optimizer) = 0;

  // One step on this replica's batch: forward, backward, and this scheme's exchange.
  virtual StepStats step(const Batch& batch, const LossFn& loss) = 0;

  // Schemes that fetch a sparse model's rows ahead (ps) say so; the Trainer then calls
  // upcoming() before every step() with what follows that step: the next step's batch (at an
  // epoch's end, the next epoch's first), or an empty batch (undefined tensors) when no step
  // follows, or when an evaluation or checkpoint that needs this process's whole model does. After
  // an empty one the scheme fetches no rows with the step; synchronize() brings the whole model.
  virtual bool readsAhead() const { return false; }
  virtual void upcoming(const Batch& next) {}

  // Brings the local model to the state to evaluate or checkpoint. (ps with a sparse model: on a
  // process that does not evaluate, only what its next step reads, which it already has.)
  virtual void synchronize() = 0;
  // What this process exchanged outside step() so far (average: the averages synchronize() ran
  // for evaluations, checkpoints and the end): bytes and waiting, which the run's totals add to the
  // steps'. Zero for schemes whose synchronize() exchanges nothing of its own.
  virtual StepStats offStepStats() const { return {}; }

  // Where training should resume, when the scheme keeps that itself (ps: the servers count each
  // worker's steps); known after attach().
  virtual std::optional<int64_t> resumeStep() const { return std::nullopt; }

  // After the last step, before the final evaluation (ps: the chief waits for the other workers).
  virtual void finish() {}
  // On the chief when it stops the job early (--target-accuracy), for schemes without a
  // communicator to broadcast that: the other replicas learn it from StepStats::stopJob.
  virtual void requestStop() {}

  // The chief's scheme-specific fields for the done event, once evaluation is over (ps: the
  // servers' staleness and byte counts).
  virtual MetricFields report() { return {}; }

  // On the chief after finish(), for schemes that keep the checkpoints themselves
  // (CheckpointPlan::keptByScheme; ps: the shards): why the final one could not be written, one
  // line naming where and why. The trainer fails the run with it after its done event.
  virtual std::optional<std::string> finalCheckpointError() const { return std::nullopt; }

  // --autocast: the dtype step()'s forward passes and losses run in under autocast (forwardLoss);
  // none: float32. float16 comes with a GradScaler (scaledBackward, stepUnlessOverflow). Set by makeStrategy.
  void setAutocast(std::optional<c10::ScalarType> dtype, const GradScalerOptions& scaler = {}) {
    autocast_ = dtype;
    scaler_ = dtype == c10::kHalf ? std::make_unique<GradScaler>(scaler) : nullptr;
  }
  std::optional<c10::ScalarType> autocast() const { return autocast_; }
  // The loss scaler under --autocast fp16; null otherwise.
  GradScaler* scaler() const { return scaler_.get(); }

 private:
  std::optional<c10::ScalarType> autocast_;
  std::unique_ptr<GradScaler> scaler_;
};

// --autocast fp16's loss scaler in a checkpoint: [scale, good steps in a row, skipped steps] as
// float64 on the CPU; and back, throwing IoError that names `where` for a tensor that is no
// scaler's state.
torch::Tensor scalerStateTensor(const GradScaler& scaler);
GradScalerState scalerStateFromTensor(const torch::Tensor& saved, const std::string& where);

// backward() of `loss`; with a scaler (--autocast fp16), of the scaled loss.
void scaledBackward(const torch::Tensor& loss, GradScaler* scaler);
// The optimizer's step; with a scaler, only when the unscaled gradients are all finite (else the
// step is skipped and the scale backs off).
void stepUnlessOverflow(torch::nn::Module& model, torch::optim::Optimizer& optimizer, GradScaler* scaler);

// The loss of `model` on (inputs, targets), the forward pass and the loss under autocast in
// `autocast` on the inputs' device kind when it is set (cohort::Autocast); backward is the caller's,
// outside it, as torch advises.
torch::Tensor forwardLoss(torch::nn::SequentialImpl& model, const torch::Tensor& inputs, const torch::Tensor& targets,
                          const LossFn& loss, std::optional<c10::ScalarType> autocast);

// What `cohort train` asks for: the scheme, and each scheme's options.
struct StrategyOptions {
  Scheme scheme = Scheme::kLocal;
  // The Trainer's, for schemes that keep records next to its checkpoints (pipeline: the manifest).
  std::string checkpointDir;
  bool resume = false;
  // Compression of what is exchanged (allreduce, average, ps, gossip): the --codec text (see
  // src/compress/codec.h), and the steps trained uncompressed first.
  std::string codec = "none";
  int64_t codecWarmupSteps = 0;
  // Each scheme's options, beside its handle in include/cohort/ (codec fields there are filled
  // from the two above by the factory).
  DataParallelOptions allreduce{.buffers = DataParallelOptions::Buffers::kOnRequest};
  AveragingOptions average;
  // ps (include/cohort/parameter_server.h); the shards' optimizer, checkpoints and codec are
  // filled from the run's options by the Trainer.
  ParameterServerOptions ps;
  // pipeline (see strategy/pipeline.h)
  struct Pipeline {
    int stages = 2;
    int replicas = 1;
    int microBatches = 4;
    PipeSchedule schedule = PipeSchedule::kOneFOneB;
    PipelinePartition partition;  // auto
  } pipeline;
  // --replicas: pipeline copies, or the in-process schemes' replica threads; 0: the scheme's
  // default (pipeline: 1; mirrored, central, hogwild: this host's cores).
  int replicas = 0;
  // mirrored, central, hogwild (include/cohort/replicas.h); replicas and the timeout are filled
  // by the factory.
  ReplicaOptions inProcess;
  // tensor: the processes every layer is split over (the job holds ways x replicas processes).
  int ways = 2;
  // gossip (include/cohort/gossip.h); codec, secret and seed are filled by the Trainer.
  GossipOptions gossip;
  // --autocast: forward passes in this 16-bit dtype (bfloat16: every scheme; float16, with a loss
  // scaler: local, allreduce, average, gossip); none: float32.
  std::optional<c10::ScalarType> autocast;
  // float16's loss scaler (no flag: torch.amp.GradScaler's defaults; tests make it grow sooner).
  GradScalerOptions scaler;
  // Test hook for every scheme: worker slowRank sleeps slowSeconds in every step.
  int slowRank = -1;
  double slowSeconds = 0;
};

// The one place that maps a scheme's name to its Strategy. The schemes that form a Gloo group
// (allreduce, average, pipeline) connect the job's communicator (a collective); ps and gossip
// talk over sockets of their own. Throws InvalidArgument for an unknown scheme, or one that cannot
// run in this job (a single-process scheme in a job of several workers, and the reverse).
std::unique_ptr<Strategy> makeStrategy(const StrategyOptions& options, const Job& job);

// Throws InvalidArgument when --codec or --codec-warmup-steps is malformed or does not fit the
// scheme; the message names the accepted codecs.
void checkCodecOptions(const StrategyOptions& options);

// Throws InvalidArgument when --autocast names a dtype the scheme cannot take: float16 needs the
// loss scaler, which sits where a scheme steps its own optimizer (local, allreduce, average,
// gossip); anything but bfloat16 and float16.
void checkAutocastOptions(const StrategyOptions& options);

// The replica threads an in-process scheme runs: --replicas, else this host's cores.
int replicaThreads(const StrategyOptions& options);

}  // namespace cohort
