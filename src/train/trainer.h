// The training loop: data, epochs, evaluation, checkpoints, metrics and progress.
#pragma once

#include "strategy/strategy.h"
#include "train/optimizer.h"
#include "train/step_profiler.h"

#include <cstdint>
#include <functional>
#include <utility>
#include <optional>
#include <string>

namespace cohort {

enum class ProgressMode { kAuto, kBar, kLines, kOff };

// The most --steps (and --epochs) a run may ask for. A step takes a millisecond at the least, so
// 10^12 steps are 30 years of training: a larger count is a slip (--steps 1e23, a script's
// overflow), and the step arithmetic (epochs x steps per epoch, steps x batch) stays far from
// int64's end.
inline constexpr int64_t kMaxSteps = 1'000'000'000'000;

struct TrainOptions {
  std::string model = "cnn";
  std::string data = "fashion-mnist";
  int64_t epochs = 1;
  int64_t steps = 0;  // when > 0, train this many steps in all and ignore epochs
  int64_t batch = 64;  // per replica
  double lr = 0.01;
  OptimizerKind optimizer = OptimizerKind::kMomentum;
  double momentum = 0.9;
  int threads = 0;  // intra-op threads; 0 = $OMP_NUM_THREADS, else cores / workers on this host
  // Where the model trains (resolveDevice): "auto" is the local rank's GPU for the schemes that
  // train on devices (Strategy::trainsOnDevices) when there is one, else the CPU.
  std::string device = "auto";
  // What carries the workers' collectives over CUDA tensors (--backend): kNccl needs the model on
  // a GPU (Trainer::run refuses it on the CPU).
  CommBackend backend = CommBackend::kAuto;
  uint64_t seed = 1;
  int64_t evalEvery = 0;  // steps; 0 = at the end only
  double targetAccuracy = 0.0;  // stop at the first evaluation that reaches it; 0 = never
  double maxSeconds = 0.0;      // stop at the first evaluation this long after the start (a resumed run:
                                // the run's, which its checkpoint's clock carries); 0 = never
  std::string checkpointDir;
  int64_t checkpointEvery = 0;  // steps; 0 = at the end only (when checkpointDir is set)
  bool resume = false;
  int64_t validation = 0;  // training examples held out for model selection (val_accuracy, val_loss)
  uint64_t validationSeed = 1;  // which ones: the same for every --seed, so that trials compare
  // How many times `cohort launch --max-restarts` restarted this process or its job
  // (COHORT_RESTART_COUNT). When > 0 the run resumes by itself: from the newest checkpoint in
  // checkpointDir (from scratch when there is none yet), and under ps at this worker's clock on
  // the shards. The chief's metrics go on in the same file and its done event counts them.
  int restartCount = 0;
  // Testing (--test-kill-at): after this many steps the process kills itself with SIGKILL, in its
  // first run only (restartCount 0); 0: never.
  int64_t testKillAtStep = 0;
  // Testing (--test-nan-at): the inputs of this step (1-based) are NaN, in the first run only; 0: never.
  int64_t testNanAtStep = 0;
  std::string metricsPath;  // JSON lines; empty = none
  std::string tensorboardDir;  // the chief's TensorBoard event files; empty = none
  ProfileOptions profile;      // --profile: a trace of a window of steps; empty path = none
  std::string saveModelPath;  // the trained model (torch::save); "{rank}" in it: every rank writes
  double timeoutSeconds = 60.0;  // every wait on a peer
  ProgressMode progress = ProgressMode::kAuto;
  double progressIntervalSeconds = 5.0;  // for kLines
  StrategyOptions strategy;
  // The training loss; empty: cross-entropy.
  LossFn loss;
  // Evaluation of one test batch: the sums over its examples of the loss and of the metric. The
  // reported test loss and accuracy are these sums over the test set divided by its size. Empty:
  // cross-entropy and accuracy (the argmax equals the label).
  std::function<std::pair<double, double>(const torch::Tensor& output, const torch::Tensor& target)> evaluate;
};

// Throws InvalidArgument naming the first option that is out of range.
void validate(const TrainOptions& options);

struct TrainResult {
  int64_t steps = 0;
  int64_t epochs = 0;  // epochs begun
  double testAccuracy = 0.0;
  double testLoss = 0.0;
  std::optional<double> validationAccuracy;  // with --validation
  std::optional<double> validationLoss;
  double lastTrainLoss = 0.0;
  double wallSeconds = 0.0;       // the run's, a resumed one's counting from its checkpoint's clock
  double samplesPerSecond = 0.0;  // steady state, all replicas, evaluation excluded
  std::optional<double> secondsToTarget;
  int64_t bytesSent = 0;
  int64_t bytesReceived = 0;
  double commWaitSeconds = 0.0;
};

class Trainer {
 public:
  explicit Trainer(TrainOptions options);
  ~Trainer();
  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;

  TrainResult run();

  torch::nn::Sequential model() const;
  bool isChief() const;

 private:
  std::string nonFiniteLossCause(double loss, int64_t step, double previousLoss) const;

  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace cohort
