// The Trainer's insides, shared by the files that implement it: Trainer::State, what one process's
// run holds, and the checks its set-up makes. By file:
//   trainer.cpp              the set-up: the job, the data, the model, the optimizer, the strategy
//   trainer_checks.cpp       the options that cannot work, refused before anything starts
//   trainer_checkpoints.cpp  checkpoints: the archive, saving, restoring and resuming
//   trainer_evaluation.cpp   scoring the model on the test and validation sets, and the eval event
//   training_loop.cpp        Trainer::run: the epochs of steps and the end of the run
#pragma once

#include "base/clock.h"
#include "base/tensorboard.h"
#include "train/evaluation.h"
#include "train/trainer.h"
#include <cohort/checkpoint.h>
#include <cohort/cluster.h>
#include <cohort/communicator.h>
#include <cohort/metrics.h>
#include <cohort/sampler.h>

#include <torch/torch.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace cohort {

struct Trainer::State {
  TrainOptions options;
  DataSplits data;
  torch::nn::Sequential model{nullptr};
  std::unique_ptr<torch::optim::Optimizer> optimizer;
  ClusterSpec cluster;
  std::shared_ptr<Communicator> comm;  // null for a single process
  std::unique_ptr<Strategy> strategy;
  c10::Device device{c10::kCPU};  // where the model, its batches and its optimizer state are
  std::unique_ptr<ShardSampler> sampler;
  CheckpointPlan checkpointPlan;
  std::unique_ptr<CheckpointStore> checkpoints;  // on the processes that write checkpoints
  std::unique_ptr<MetricsWriter> metrics;
  std::unique_ptr<TensorBoardWriter> board;  // the chief's, with --tensorboard
  int evaluators = 0;                        // evaluator tasks in the cluster: they evaluate, the chief checkpoints
  ReplicaInfo replica;
  int64_t step = 0;         // steps completed
  int64_t epoch = 0;        // the epoch under way
  int64_t stepInEpoch = 0;  // its steps completed
  // The run's clock (wall_s, --max-seconds, seconds_to_target): it counts the seconds the run had
  // trained before the checkpoint this process resumed from (its wall_s), so a resumed run goes on
  // from there instead of from 0. startClock() sets it as the loop starts.
  double wallSecondsBefore = 0.0;
  Clock::time_point clockStart = Clock::now();
  Clock::time_point startClock() {
    clockStart =
        Clock::now() - std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(wallSecondsBefore));
    return clockStart;
  }
  // The strategy's own state from the checkpoint resumed, until attach() has made the strategy's.
  std::optional<torch::serialize::InputArchive> strategyState;
  std::string strategyStateSource;  // the checkpoint it came from

  void warn(const std::string& message);

  // The set-up (trainer.cpp), in the order the constructor takes its steps.
  void joinJob();
  void loadTrainingData();
  void buildModel();
  void checkModelOutputs(const TrainOptions& o, const Batch& sample, int64_t classes);
  void placeModel();
  void makeSampler();
  void planCheckpoints();
  void attachStrategy();
  void openChiefOutputs();

  // Checkpoints (trainer_checkpoints.cpp).
  std::vector<uint8_t> serialize();
  void restore(const LoadedCheckpoint& ckpt);
  void resume();
  std::optional<LoadedCheckpoint> loadChiefCheckpoint(int64_t upTo = INT64_MAX);
  std::optional<std::string> saveCheckpoint(bool final);

  // Evaluation (trainer_evaluation.cpp).
  struct Eval {
    Scores test;
    std::optional<Scores> validation;
  };
  Eval evaluate();
  Scores evaluateOn(const Dataset& set);
  // The chief's record of an evaluation: the eval event's step, epoch and scores, and its
  // TensorBoard scalars.
  MetricFields evalFields(const Eval& ev) const;
  void boardEval(const Eval& ev);
  std::string evalMessage(const Eval& ev) const;  // the progress line

  class Loop;  // Trainer::run (training_loop.cpp)
};

// Where this process trains: --device resolved on this machine when the run can train there; the
// CPU under "auto" when it cannot, and an error naming why for an explicit device.
c10::Device chooseDevice(const TrainOptions& o, const Strategy& strategy, torch::nn::Module& model, int localRank);

// --backend nccl carries CUDA tensors only: a run whose model is on the CPU is refused, saying why
// it is there. (A build without NCCL refuses it earlier: validate().)
void checkBackend(const TrainOptions& o, const Strategy& strategy, torch::nn::Module& model, const c10::Device& device);
// The model on `device` against the options that cannot train it: --average-optimizer-state over
// sparse tables (the lazy optimizer's state), --autocast fp16 with a recurrent layer on the CPU.
void checkModelForRun(const TrainOptions& o, torch::nn::Module& model, const c10::Device& device);

}  // namespace cohort
