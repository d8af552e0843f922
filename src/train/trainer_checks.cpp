// The Trainer's option checks: validate() refuses the options that are out of range before
// anything starts; chooseDevice() and checkBackend() refuse a device or a backend this run cannot
// train on, once the scheme and the model are known.
#include "schemes/model_sync.h"
#include "train/trainer_internal.h"
#include <cohort/device.h>
#include <cohort/error.h>

#include <cmath>
#include <thread>

namespace cohort {

namespace {

// --threads above this many per core is a mistake (100000 would hang creating threads).
constexpr int kThreadsPerCore = 16;
// The longest --timeout: longer waits are hangs, and seconds * 1000 must fit the clocks.
constexpr double kMaxTimeoutSeconds = 7 * 24 * 3600;

// Why this run trains on the CPU whatever --device says; "" when it can train on a device.
std::string cpuOnlyReason(const TrainOptions& o, const Strategy& strategy, torch::nn::Module& model) {
  if (!strategy.trainsOnDevices()) {
    return "--strategy " + strategy.name() +
           " trains on the CPU only in this version (on a device so far: local, "
           "allreduce, average, ps, gossip, pipeline, tensor, mirrored and central)";
  }
  if (hasRowSparseTable(model)) {
    return "--model " + o.model +
           " has sparse embeddings, whose optimizer and exchange work on host memory only "
           "so far";
  }
  return "";
}

}  // namespace

void validate(const TrainOptions& o) {
  COHORT_CHECK(o.batch > 0, InvalidArgument, "--batch must be positive, got ", o.batch);
  COHORT_CHECK(o.backend != CommBackend::kNccl || hasNccl(), InvalidArgument,
               "--backend nccl: this cohort was built without NCCL (its LibTorch has no c10d ProcessGroupNCCL, or "
               "CMake found no nccl.h): use --backend gloo or auto, or rebuild cohort against a LibTorch with NCCL "
               "(PyPI's torch==2.11.0, which scripts/setup.sh installs, has it)");
  COHORT_CHECK(o.lr > 0 && std::isfinite(o.lr), InvalidArgument, "--lr must be a positive number, got ", o.lr);
  COHORT_CHECK(o.steps >= 0 && o.steps <= kMaxSteps, InvalidArgument, "--steps must be in 0..", kMaxSteps, ", got ",
               o.steps);
  COHORT_CHECK(o.steps > 0 || o.epochs > 0, InvalidArgument, "--epochs must be positive, got ", o.epochs);
  COHORT_CHECK(o.epochs <= kMaxSteps, InvalidArgument, "--epochs must be in 1..", kMaxSteps, ", got ", o.epochs);
  const int cores = int(std::max(1u, std::thread::hardware_concurrency()));
  COHORT_CHECK(o.threads >= 0 && o.threads <= kThreadsPerCore * cores, InvalidArgument, "--threads must be in 0..",
               kThreadsPerCore * cores, " (at most ", kThreadsPerCore, " per core on this machine's ", cores,
               "; 0: all cores), got ", o.threads);
  COHORT_CHECK(o.evalEvery >= 0, InvalidArgument, "--eval-every must not be negative, got ", o.evalEvery);
  COHORT_CHECK(o.targetAccuracy >= 0 && o.targetAccuracy <= 1, InvalidArgument,
               "--target-accuracy must be between 0 and 1, got ", o.targetAccuracy);
  COHORT_CHECK(o.maxSeconds >= 0, InvalidArgument, "--max-seconds must not be negative, got ", o.maxSeconds);
  COHORT_CHECK(o.checkpointEvery >= 0, InvalidArgument, "--checkpoint-every must not be negative, got ",
               o.checkpointEvery);
  COHORT_CHECK(!o.resume || !o.checkpointDir.empty(), InvalidArgument,
               "--resume needs --checkpoint-dir to find the checkpoint");
  // Under ps the workers' --checkpoint-every tells the shards, which have a directory of their own.
  COHORT_CHECK(o.checkpointEvery == 0 || !o.checkpointDir.empty() || o.strategy.scheme == Scheme::kPs, InvalidArgument,
               "--checkpoint-every ", o.checkpointEvery,
               " without --checkpoint-dir writes no checkpoint: give --checkpoint-dir DIR");
  // They are looked at when the run evaluates; with --eval-every 0 that is only at its end.
  COHORT_CHECK(o.evalEvery > 0 || (o.maxSeconds == 0 && o.targetAccuracy == 0), InvalidArgument,
               o.maxSeconds > 0 ? "--max-seconds" : "--target-accuracy",
               " stops the run at an evaluation, and with --eval-every 0 the run evaluates only at its end: give "
               "--eval-every N (steps between evaluations)");
  // The chief's model there is its stage or its way, not the whole model the file would name
  // (with {rank} in the path each process writes its own part, as it is).
  COHORT_CHECK(o.saveModelPath.empty() || o.saveModelPath.find("{rank}") != std::string::npos ||
                   (o.strategy.scheme != Scheme::kPipeline && o.strategy.scheme != Scheme::kTensor),
               InvalidArgument, "--save-model writes the whole model, and --strategy ", schemeName(o.strategy.scheme),
               " keeps a part of it on each process (", o.strategy.scheme == Scheme::kPipeline ? "a stage" : "a way",
               "): drop --save-model, or put {rank} in its path to write each process's part");
  COHORT_CHECK(o.momentum >= 0 && o.momentum < 1, InvalidArgument, "--momentum must be in [0, 1), got ", o.momentum);
  COHORT_CHECK(o.strategy.average.outerLr > 0 && std::isfinite(o.strategy.average.outerLr), InvalidArgument,
               "--outer-lr must be a positive number, got ", o.strategy.average.outerLr);
  COHORT_CHECK(o.validation >= 0, InvalidArgument, "--validation must not be negative, got ", o.validation);
  COHORT_CHECK(o.timeoutSeconds > 0 && o.timeoutSeconds <= kMaxTimeoutSeconds, InvalidArgument,
               "--timeout must be a number of seconds in (0, ", kMaxTimeoutSeconds, "] (a week), got ",
               o.timeoutSeconds);
  COHORT_CHECK(o.restartCount >= 0, InvalidArgument, "COHORT_RESTART_COUNT must not be negative, got ", o.restartCount);
  if (isInProcess(o.strategy.scheme)) {
    const int replicas = replicaThreads(o.strategy);
    COHORT_CHECK(replicas <= o.batch, InvalidArgument, "--replicas ", replicas, " is larger than --batch ", o.batch,
                 ": --strategy ", schemeName(o.strategy.scheme),
                 " splits each batch over its replicas; use --batch of at least ", replicas, " or fewer --replicas");
  }
}

c10::Device chooseDevice(const TrainOptions& o, const Strategy& strategy, torch::nn::Module& model, int localRank) {
  const c10::Device device = resolveDevice(o.device, localRank);  // throws for a device that is not here
  if (device.is_cpu()) return device;
  const std::string reason = cpuOnlyReason(o, strategy, model);
  if (reason.empty()) return device;
  if (!isExplicitDevice(o.device)) return c10::Device(c10::kCPU);
  COHORT_CHECK(strategy.scheme() != Scheme::kHogwild, InvalidArgument,
               "--strategy hogwild is a CPU scheme (its threads update one copy of the parameters in host memory "
               "without locks); use --device cpu, or --strategy mirrored (replicas as threads) on the GPU");
  throw InvalidArgument("--device " + o.device + ": " + reason + "; use --device cpu");
}

void checkModelForRun(const TrainOptions& o, torch::nn::Module& model, const c10::Device& device) {
  const bool sparse = hasRowSparseTable(model);
  // makeOptimizer() gives such a model the lazy row optimizer, which ParameterAveraging refused
  // as "not SGD, Adam or AdamW" whatever --optimizer said.
  COHORT_CHECK(!(o.strategy.scheme == Scheme::kAverage && o.strategy.average.averageOptimizerState && sparse),
               InvalidArgument, "--average-optimizer-state: --model ", o.model,
               " has sparse embedding tables, which train with the lazy row optimizer, whose state is not averaged: "
               "drop --average-optimizer-state, or use dense tables (embed:sparse=0)");
  // oneDNN has no float16 LSTM on the CPU: the first step failed with "could not create a
  // primitive descriptor for the LSTM forward propagation primitive".
  if (o.strategy.autocast == c10::kHalf && device.is_cpu()) {
    bool recurrent = false;
    for (const auto& m : model.modules(/*include_self=*/false)) {
      recurrent = recurrent || m->as<torch::nn::LSTMImpl>() != nullptr || m->as<torch::nn::GRUImpl>() != nullptr ||
                  m->as<torch::nn::RNNImpl>() != nullptr;
    }
    COHORT_CHECK(!recurrent, InvalidArgument, "--autocast fp16 on the CPU: --model ", o.model,
                 " has a recurrent layer (LSTM, GRU or RNN), which has no float16 kernel on the CPU: use --autocast "
                 "bf16, or a GPU");
  }
}

void checkBackend(const TrainOptions& o, const Strategy& strategy, torch::nn::Module& model,
                  const c10::Device& device) {
  if (o.backend != CommBackend::kNccl || device.is_cuda()) return;
  std::string why = cpuOnlyReason(o, strategy, model);
  if (o.device == "cpu") {
    why = "--device cpu";
  } else if (why.empty()) {
    why = "this process sees no GPU";
  }
  throw InvalidArgument("--backend nccl carries collectives over CUDA tensors, but this run's model is on the CPU (" +
                        why +
                        "): use --device cuda with --strategy allreduce on a machine with a GPU per process, "
                        "or --backend gloo or auto");
}

}  // namespace cohort
