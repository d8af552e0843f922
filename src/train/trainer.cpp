#include <cohort/checkpoint.h>
#include <cohort/cluster.h>
#include <cohort/communicator.h>
#include <cohort/device.h>
#include <cohort/error.h>
#include <cohort/job.h>
#include <cohort/metrics.h>
#include <cohort/models.h>
#include <cohort/sampler.h>
#include "base/clock.h"
#include "base/launcher_channel.h"
#include "base/tensorboard.h"
#include "models/cpu_generator.h"
#include "train/evaluation.h"
#include "train/evaluator.h"
#include "train/model_file.h"
#include "train/trainer.h"

#include "schemes/model_sync.h"
#include "train/lazy_optimizer.h"
#include "train/progress.h"
#include "train/threads.h"

#include <c10/cuda/CUDACachingAllocator.h>
#include <torch/torch.h>

#include <sys/resource.h>

#include <csignal>
#include <chrono>
#include <limits>
#include <optional>
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <thread>

namespace cohort {

namespace {

// Steps at the start of a run that the throughput figure leaves out (allocator and JIT warm-up).
constexpr int64_t kWarmupSteps = 5;
constexpr int64_t kEvalBatch = 1000;
// --threads above this many per core is a mistake (100000 would hang creating threads).
constexpr int kThreadsPerCore = 16;
// The longest --timeout: longer waits are hangs, and seconds * 1000 must fit the clocks.
constexpr double kMaxTimeoutSeconds = 7 * 24 * 3600;
// A loss above this before one that is not finite is called divergence.
constexpr double kDivergingLoss = 1e4;

// Why this run trains on the CPU whatever --device says; "" when it can train on a device.
std::string cpuOnlyReason(const TrainOptions& o, const Strategy& strategy, torch::nn::Module& model) {
  if (!strategy.trainsOnDevices()) {
    return "--strategy " + strategy.name() + " trains on the CPU only in this version (on a device so far: local, "
           "allreduce, average, ps, gossip, pipeline, tensor, mirrored and central)";
  }
  for (const auto& p : model.parameters()) {
    if (hasRowSparseGradient(model, p)) {
      return "--model " + o.model + " has sparse embeddings, whose optimizer and exchange work on host memory only "
             "so far";
    }
  }
  return "";
}

// Where this process trains: --device resolved on this machine when the run can train there; the
// CPU under "auto" when it cannot, and an error naming why for an explicit device.
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

// --backend nccl carries CUDA tensors only: a run whose model is on the CPU is refused, saying why
// it is there. (A build without NCCL refuses it earlier: validate().)
void checkBackend(const TrainOptions& o, const Strategy& strategy, torch::nn::Module& model, const c10::Device& device) {
  if (o.backend != CommBackend::kNccl || device.is_cuda()) return;
  std::string why = cpuOnlyReason(o, strategy, model);
  if (o.device == "cpu") {
    why = "--device cpu";
  } else if (why.empty()) {
    why = "this process sees no GPU";
  }
  throw InvalidArgument("--backend nccl carries collectives over CUDA tensors, but this run's model is on the CPU (" +
                        why + "): use --device cuda with --strategy allreduce on a machine with a GPU per process, "
                        "or --backend gloo or auto");
}

// A tensor assembled in host memory, on `device`: pinned and copied without blocking the host (the
// copy is ordered before the step's kernels on the same stream).
torch::Tensor onDevice(const torch::Tensor& t, const c10::Device& device) {
  if (device.is_cpu() || !t.defined()) return t;
  return t.pin_memory().to(device, /*non_blocking=*/true);
}

// A training batch on `device`: its inputs and its targets.
Batch onDevice(Batch batch, const c10::Device& device) {
  batch.inputs = onDevice(batch.inputs, device);
  batch.targets = onDevice(batch.targets, device);
  return batch;
}

std::unique_ptr<torch::optim::Optimizer> makeOptimizer(const TrainOptions& o, torch::nn::Module& model) {
  const std::vector<torch::Tensor> params = model.parameters();
  for (const auto& p : params) {
    // A sparse embedding table: updates by rows, lazily (train/lazy_optimizer.h).
    if (hasRowSparseGradient(model, p)) return std::make_unique<LazyOptimizer>(params, o.optimizer, o.lr, o.momentum);
  }
  if (o.optimizer == "sgd") {
    return std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(o.lr));
  }
  if (o.optimizer == "momentum") {
    return std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(o.lr).momentum(o.momentum));
  }
  if (o.optimizer == "adam") {
    return std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(o.lr));
  }
  if (o.optimizer == "adagrad") {
    return std::make_unique<torch::optim::Adagrad>(params, torch::optim::AdagradOptions(o.lr));
  }
  throw InvalidArgument("unknown optimizer '" + o.optimizer + "': expected sgd, momentum, adam or adagrad");
}

torch::Tensor crossEntropy(const torch::Tensor& output, const torch::Tensor& target) {
  return torch::nn::functional::cross_entropy(output, target);
}

// What a checkpoint must agree on with the run that resumes it.
std::string fingerprint(const TrainOptions& o, const ReplicaInfo& r, const std::string& layout) {
  std::ostringstream out;
  out << "model=" << o.model << " data=" << o.data << " batch=" << o.batch
      << " optimizer=" << o.optimizer << " strategy=" << schemeName(o.strategy.scheme)
      << " workers=" << r.worldSize << " seed=" << o.seed;
  if (o.validation > 0) out << " validation=" << o.validation << ":" << o.validationSeed;
  if (!layout.empty()) out << " " << layout;
  return out.str();
}

// This process's peak resident memory so far.
double maxRssMb() {
  struct rusage usage {};
  ::getrusage(RUSAGE_SELF, &usage);
  return double(usage.ru_maxrss) / 1024.0;
}

// Threads for this process when --threads is not given: OMP_NUM_THREADS (cohort launch sets it),
// else this host's cores shared among the workers on it.
int defaultThreads() {
  if (const char* env = std::getenv("OMP_NUM_THREADS"); env != nullptr && std::atoi(env) > 0) return std::atoi(env);
  const int cores = int(std::max(1u, std::thread::hardware_concurrency()));
  int local = 1;
  try {
    local = std::max(1, resolveClusterFromEnvironment().localWorldSize);
  } catch (const Error&) {
    // reported when the trainer resolves the cluster
  }
  return std::max(1, cores / local);
}

// The step's scalars for TensorBoard.
std::vector<std::pair<std::string, float>> boardScalars(const StepStats& stats, double samplesPerSecond, double lr) {
  std::vector<std::pair<std::string, float>> scalars{{"train/loss", float(stats.loss)},
                                                     {"train/samples_per_s", float(samplesPerSecond)},
                                                     {"train/bytes_sent", float(stats.bytesSent)},
                                                     {"train/bytes_received", float(stats.bytesReceived)},
                                                     {"train/comm_wait_s", float(stats.commWaitSeconds)},
                                                     {"train/learning_rate", float(lr)}};
  for (const auto& [key, value] : stats.extra) {
    if (key.rfind("staleness", 0) != 0) continue;  // the schemes that have one: ps, gossip
    if (const auto* d = std::get_if<double>(&value)) scalars.emplace_back("train/" + key, float(*d));
    if (const auto* i = std::get_if<int64_t>(&value)) scalars.emplace_back("train/" + key, float(*i));
  }
  return scalars;
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
  COHORT_CHECK(o.momentum >= 0 && o.momentum < 1, InvalidArgument, "--momentum must be in [0, 1), got ",
               o.momentum);
  COHORT_CHECK(o.strategy.average.outerLr > 0 && std::isfinite(o.strategy.average.outerLr), InvalidArgument,
               "--outer-lr must be a positive number, got ", o.strategy.average.outerLr);
  COHORT_CHECK(o.validation >= 0, InvalidArgument, "--validation must not be negative, got ", o.validation);
  COHORT_CHECK(o.timeoutSeconds > 0 && o.timeoutSeconds <= kMaxTimeoutSeconds, InvalidArgument,
               "--timeout must be a number of seconds in (0, ", kMaxTimeoutSeconds, "] (a week), got ", o.timeoutSeconds);
  COHORT_CHECK(o.restartCount >= 0, InvalidArgument, "COHORT_RESTART_COUNT must not be negative, got ",
               o.restartCount);
  if (isInProcess(o.strategy.scheme)) {
    const int replicas = replicaThreads(o.strategy);
    COHORT_CHECK(replicas <= o.batch, InvalidArgument, "--replicas ", replicas, " is larger than --batch ", o.batch,
                 ": --strategy ", schemeName(o.strategy.scheme), " splits each batch over its replicas; use --batch of at least ",
                 replicas, " or fewer --replicas");
  }
  COHORT_CHECK(o.optimizer == "sgd" || o.optimizer == "momentum" || o.optimizer == "adam" || o.optimizer == "adagrad",
               InvalidArgument, "unknown optimizer '", o.optimizer, "': expected sgd, momentum, adam or adagrad");
}

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
  int evaluators = 0;  // evaluator tasks in the cluster: they evaluate, the chief checkpoints
  ReplicaInfo replica;
  int64_t step = 0;         // steps completed
  int64_t epoch = 0;        // the epoch under way
  int64_t stepInEpoch = 0;  // its steps completed
  // The strategy's own state from the checkpoint resumed, until attach() has made the strategy's.
  std::optional<torch::serialize::InputArchive> strategyState;
  std::string strategyStateSource;  // the checkpoint it came from

  void warn(const std::string& message) { std::fprintf(stderr, "cohort: warning: %s\n", message.c_str()); }

  std::vector<uint8_t> serialize() {
    torch::serialize::OutputArchive archive;
    torch::serialize::OutputArchive modelArchive;
    model->save(modelArchive);
    archive.write("model", modelArchive);
    torch::serialize::OutputArchive optimizerArchive;
    optimizer->save(optimizerArchive);
    archive.write("optimizer", optimizerArchive);
    torch::serialize::OutputArchive strategyArchive;
    strategy->saveState(strategyArchive);
    archive.write("strategy", strategyArchive);
    archive.write("step", c10::IValue(step));
    archive.write("epoch", c10::IValue(epoch));
    archive.write("step_in_epoch", c10::IValue(stepInEpoch));
    archive.write("fingerprint", c10::IValue(fingerprint(options, replica, strategy->layout())));
    archive.write("rng", cpuGeneratorState());
    std::vector<uint8_t> bytes;
    archive.save_to([&](const void* data, size_t size) {
      auto p = static_cast<const uint8_t*>(data);
      bytes.insert(bytes.end(), p, p + size);
      return size;
    });
    return bytes;
  }

  // A checkpoint that verifies can still hold data that is not what cohort wrote (damaged before
  // its checksum was made, or written by hand): every failure to read it is an IoError naming it.
  void restore(const LoadedCheckpoint& ckpt) {
    const std::string& path = ckpt.file.path;
    // Not only c10::Error: TorchScript's reader of the archive's code throws its own exceptions.
    auto firstLine = [](const std::exception& e) {
      const std::string what = e.what();
      return what.substr(0, what.find('\n'));
    };
    torch::serialize::InputArchive archive;
    c10::IValue value;
    std::string found;
    try {
      // Onto this run's device, whichever device wrote it (a GPU run resumes on a CPU and back).
      archive.load_from(reinterpret_cast<const char*>(ckpt.payload.data()), ckpt.payload.size(), device);
      archive.read("fingerprint", value);
      found = value.toStringRef();
    } catch (const std::exception& e) {
      throw IoError(path + ": checkpoint payload is unreadable: " + firstLine(e));
    }
    const std::string expected = fingerprint(options, replica, strategy->layout());
    COHORT_CHECK(found == expected, InvalidArgument, path, ": checkpoint is from a different run (", found,
                 "; this run: ", expected, "): use another --checkpoint-dir or the same settings");
    try {
      torch::serialize::InputArchive modelArchive;
      archive.read("model", modelArchive);
      model->load(modelArchive);
      torch::serialize::InputArchive optimizerArchive;
      archive.read("optimizer", optimizerArchive);
      optimizer->load(optimizerArchive);
      // Given to the strategy after attach() (which makes its state); absent in older checkpoints.
      strategyState.emplace();
      strategyStateSource = path;
      archive.try_read("strategy", *strategyState);
      archive.read("step", value);
      step = value.toInt();
      archive.read("epoch", value);
      epoch = value.toInt();
      archive.read("step_in_epoch", value);
      stepInEpoch = value.toInt();
      torch::Tensor rng;
      archive.read("rng", rng);
      setCpuGeneratorState(rng.to(torch::kCPU));  // the CPU generator's state, mapped to the device with the rest
    } catch (const std::exception& e) {
      throw IoError(path + ": checkpoint does not fit this model: " + firstLine(e));
    }
    COHORT_CHECK(step >= 0 && step <= kMaxSteps && epoch >= 0 && epoch <= kMaxSteps && stepInEpoch >= 0 &&
                     stepInEpoch <= step,
                 IoError, path, ": corrupt checkpoint: step ", step, ", epoch ", epoch, ", step_in_epoch ",
                 stepInEpoch, " are not a training position");
  }

  // The writer (the chief) reads the checkpoint and sends it to the processes that restore the
  // same model (every worker), so all resume alike even when only it can see the directory: over
  // the communicator, or for a scheme without one (gossip) through the scheme.
  void resume() {
    std::vector<uint8_t> payload;
    std::string path;
    // Processes that restore different checkpoints (pipeline stages, tensor ways) take the newest
    // step that every one of them has: a kill inside one part's write leaves the others ahead.
    int64_t upTo = INT64_MAX;
    if (comm && checkpointPlan.group) {
      int64_t newest = INT64_MAX;
      if (checkpointPlan.writes) {
        const auto files = checkpoints->list();
        newest = files.empty() ? -1 : files.front().step;
      }
      for (const auto& t : comm->allgather(torch::tensor({newest}, torch::kInt64))) {
        upTo = std::min(upTo, t.item<int64_t>());
      }
      if (checkpointPlan.writes && upTo >= 0 && upTo < newest) {
        warn("--resume: the newest checkpoint of this rank's part of the model (a pipeline stage, a tensor way) is step " +
             std::to_string(newest) + ", another part's step " + std::to_string(upTo) +
             " (a save was interrupted): resuming every part from step " + std::to_string(upTo));
      }
    }
    if (checkpointPlan.writes && upTo >= 0) {
      if (auto loaded = loadChiefCheckpoint(upTo)) {
        payload = std::move(loaded->payload);
        path = loaded->file.path;
      }
    }
    Communicator* group = checkpointPlan.group ? checkpointPlan.group.get() : comm.get();
    payload = group != nullptr ? group->broadcastBytes(payload, 0) : strategy->shareCheckpoint(std::move(payload));
    if (!payload.empty()) {
      restore(LoadedCheckpoint{{path.empty() ? "the chief's checkpoint" : path, 0}, std::move(payload)});
      if (checkpointPlan.writes) {
        std::fprintf(stderr, "cohort: resumed from %s (step %lld, epoch %lld)\n", path.c_str(), (long long)step,
                     (long long)epoch + 1);
      }
    }
    // Processes that restored different checkpoints (pipeline stages) must be at the same step.
    if (comm && checkpointPlan.group) {
      auto steps = comm->allgather(torch::tensor({step}, torch::kInt64));
      for (size_t r = 0; r < steps.size(); ++r) {
        COHORT_CHECK(steps[r].item<int64_t>() == step, InvalidArgument, "--resume: rank ", r, " restored step ",
                     steps[r].item<int64_t>(), " but rank ", replica.rank, " step ", step, " (checkpoints under ",
                     options.checkpointDir, " were written at different steps, e.g. a save was interrupted): "
                     "remove the newer files so that every part ends at the same step");
      }
    }
  }

  // The newest checkpoint that verifies, at or before step `upTo`.
  std::optional<LoadedCheckpoint> loadChiefCheckpoint(int64_t upTo = INT64_MAX) {
    std::vector<std::string> corrupt;
    std::optional<LoadedCheckpoint> loaded;
    for (const auto& file : checkpoints->list([&](const std::string& m) { warn(m); })) {
      if (file.step > upTo) continue;
      try {
        loaded = LoadedCheckpoint{file, CheckpointStore::readVerified(file.path)};
        break;
      } catch (const IoError& e) {
        corrupt.push_back(std::string(e.what()) + "; trying the next older one");
      }
    }
    if (!loaded) {
      std::string all;
      for (const auto& m : corrupt) all += (all.empty() ? "" : " | ") + m.substr(0, m.find("; trying"));
      COHORT_CHECK(corrupt.empty(), IoError, "no readable checkpoint in ", checkpoints->dir(), ": ", all);
      warn("--resume: no checkpoint in " + checkpoints->dir() + " yet; starting from scratch");
      return std::nullopt;
    }
    for (const auto& m : corrupt) warn(m);
    return loaded;
  }

  // A periodic checkpoint that cannot be written (a full disk) is reported and training goes on
  // from the previous one, as on the shards. The final one (`final`) that cannot be written is
  // returned as an error for the end of the run: the run's result still reaches its done event,
  // and the previous checkpoints are kept (a save removes older ones only after it succeeded).
  std::optional<std::string> saveCheckpoint(bool final) {
    strategy->synchronize();
    strategy->prepareCheckpoint();
    if (!checkpoints) return std::nullopt;
    try {
      checkpoints->save(step, serialize());
    } catch (const IoError& e) {
      if (!final) {
        warn(std::string("checkpoint failed, training goes on: ") + e.what());
        return std::nullopt;
      }
      const auto kept = checkpoints->list();
      std::string error = "the final checkpoint (step " + std::to_string(step) + ") could not be written to " +
                          checkpoints->dir() + ": " + e.what() + "; ";
      error += kept.empty() ? "no earlier checkpoint is there"
                            : "the newest checkpoint kept there is " + kept.front().path + " (step " +
                                  std::to_string(kept.front().step) + ")";
      error += "; the run's result is in its done event: free space on that disk or give another --checkpoint-dir";
      return error;
    }
    return std::nullopt;
  }

  struct Eval {
    Scores test;
    std::optional<Scores> validation;
  };

  // On every process that joins evaluation (strategy->joinsEvaluation()); the result is the
  // chief's. The test set, then the validation set, in the same order on every process.
  Eval evaluate() {
    torch::NoGradGuard noGrad;
    model->eval();
    Eval ev;
    ev.test = evaluateOn(data.test);
    if (data.validation.size() > 0) ev.validation = evaluateOn(data.validation);
    model->train();
    return ev;
  }

  Scores evaluateOn(const Dataset& set) {
    const int64_t n = set.size();
    ScoreAccumulator acc(data.classes);
    double lossSum = 0;    // with options.evaluate
    double metricSum = 0;
    std::vector<int64_t> idx;
    for (int64_t start = 0; start < n; start += kEvalBatch) {
      const int64_t count = std::min(kEvalBatch, n - start);
      idx.resize(size_t(count));
      std::iota(idx.begin(), idx.end(), start);
      Batch batch = makeBatch(set, idx);
      auto out = strategy->infer(model, onDevice(batch.inputs, device));  // the targets stay on the host
      if (!out.defined()) continue;  // the chief has the outputs
      out = out.to(torch::kCPU);
      if (options.evaluate) {
        const auto [loss, metric] = options.evaluate(out, batch.targets);
        lossSum += loss;
        metricSum += metric;
      } else {
        acc.add(out, batch.targets);
      }
    }
    if (!options.evaluate) return acc.scores();
    Scores custom;  // the injected metric has no classes: no F1, no per-class figures
    custom.examples = n;
    custom.loss = lossSum / double(n);
    custom.accuracy = metricSum / double(n);
    custom.macroF1 = std::numeric_limits<double>::quiet_NaN();
    return custom;
  }
};

Trainer::Trainer(TrainOptions options) : state_(std::make_unique<State>()) {
  validate(options);
  State& s = *state_;
  s.options = std::move(options);
  const TrainOptions& o = s.options;
  setComputeThreads(o.threads > 0 ? o.threads : defaultThreads());
  torch::manual_seed(o.seed);

  s.cluster = resolveClusterFromEnvironment();
  COHORT_CHECK(s.cluster.role == Role::kWorker, InvalidArgument, "this process is not a worker (",
               describe(s.cluster), "): cohort train runs workers only");
  // The scheme is the factory's business; the Trainer gives it the run's options it needs.
  StrategyOptions so = o.strategy;
  so.checkpointDir = o.checkpointDir;
  so.resume = o.resume;
  so.ps.optimizer = o.optimizer;
  so.ps.lr = o.lr;
  so.ps.momentum = o.momentum;
  so.ps.checkpointEvery = o.checkpointEvery;
  so.ps.resume = o.resume || o.restartCount > 0;  // a restarted worker takes up its clock on the shards
  so.gossip.authToken = o.strategy.ps.authToken;
  so.gossip.seed = o.seed;
  const Job job =
      Job::fromSpec(s.cluster, {.timeout = std::chrono::milliseconds(int64_t(o.timeoutSeconds * 1000)),
                                .backend = o.backend});
  s.strategy = makeStrategy(so, job);
  s.comm = s.strategy->communicator();
  s.replica = s.strategy->replica();
  // A ps chief hosts no store: cohort launch may start the other workers now, while this one loads
  // the data and sends the shards their Init (they wait for it at the shards). Said once attached,
  // as for the schemes below, the others began ~1.3 s after the chief on the cnn, and the chief's
  // first ~20 steps ran alone, which bench/ps.py's rate counted (docs/BENCHMARKS.md).
  if (s.cluster.isChief() && s.strategy->scheme() == Scheme::kPs) launcher::tellNoPort();
  s.data = loadData(o.data, o.seed);
  holdOutValidation(s.data, o.validation, o.validationSeed);
  // A larger batch would silently be the whole training set, every step.
  COHORT_CHECK(o.batch <= s.data.train.size(), InvalidArgument, "--batch ", o.batch, " is larger than the ",
               s.data.train.size(), " training examples of --data ", o.data, ": use --batch of at most ",
               s.data.train.size());
  if (s.data.bags()) {
    s.model = makeModel(o.model, {.channels = 1, .height = 1, .width = 1, .classes = s.data.classes,
                                  .featureRows = s.data.featureRows, .featureRowsSource = s.data.featureRowsSource});
    if (s.replica.isChief() && s.data.attainableAccuracy >= 0) {
      std::fprintf(stderr, "cohort: %s: %lld examples; the hidden model's test accuracy (the attainable optimum) is %.4f\n",
                   s.data.name.c_str(), (long long)s.data.train.size(), s.data.attainableAccuracy);
    }
  } else {
    s.model = makeModel(o.model, {s.data.channels(), s.data.height(), s.data.width(), s.data.classes});
  }
  s.model->train();
  COHORT_CHECK(s.data.train.size() > 0, InvalidArgument, "the training set is empty");
  {
    std::vector<int64_t> first(size_t(std::min(o.batch, s.data.train.size())));
    std::iota(first.begin(), first.end(), 0);
    s.model = s.strategy->localModel(s.model, makeBatch(s.data.train, first));
  }
  s.device = chooseDevice(o, *s.strategy, *s.model, s.cluster.localRank);
  checkBackend(o, *s.strategy, *s.model, s.device);
  if (!s.device.is_cpu()) s.model->to(s.device);  // before the optimizer: its state follows the parameters
  s.optimizer = makeOptimizer(o, *s.model);
  const DataShard shard = s.strategy->dataShard();
  s.sampler = std::make_unique<ShardSampler>(SamplerOptions{.datasetSize = s.data.train.size(),
                                                            .rank = shard.index,
                                                            .worldSize = shard.count,
                                                            .seed = o.seed});
  COHORT_CHECK(s.sampler->samplesPerRank() > 0, InvalidArgument, "the training set is empty");
  // The chief (pipeline: each stage of replica 0) reads and writes checkpoints; under ps the
  // shards checkpoint the parameters.
  s.checkpointPlan = s.strategy->checkpointPlan();
  const bool serverCheckpoints = s.checkpointPlan.keptByScheme;
  if (!o.checkpointDir.empty() && s.checkpointPlan.writes && !serverCheckpoints) {
    const std::string dir =
        s.checkpointPlan.subdir.empty() ? o.checkpointDir : o.checkpointDir + "/" + s.checkpointPlan.subdir;
    s.checkpoints = std::make_unique<CheckpointStore>(dir);
  }
  s.evaluators = int(s.cluster.evaluators.size());
  if (s.evaluators > 0) {
    COHORT_CHECK(!o.checkpointDir.empty(), InvalidArgument, "the cluster has an evaluator task, which evaluates "
                 "the checkpoints the chief writes, but no --checkpoint-dir was given: give one to every task");
    COHORT_CHECK(s.checkpoints != nullptr || !s.replica.isChief(), InvalidArgument, "--strategy ",
                 schemeName(o.strategy.scheme),
                 " does not write whole-model checkpoints, which an evaluator task reads: drop the evaluator task");
    COHORT_CHECK(o.targetAccuracy == 0, InvalidArgument, "--target-accuracy needs the chief's own evaluation, and "
                 "the cluster has an evaluator task: drop one of them");
    if (s.checkpoints) {
      const std::string dir = s.checkpoints->dir();
      const int evaluators = s.evaluators;
      s.checkpoints->keepUnread([dir, evaluators] { return evaluatedByAll(dir, evaluators); });
      if (!o.resume) removeTrainingDone(dir);  // an earlier run's
    }
  }
  if (o.resume && !serverCheckpoints) s.resume();
  // attach after resume: it makes every replica start from the chief's (restored) parameters.
  // Gossip binds its store when it attaches the model, blocking until its peers have joined: the
  // chief tells cohort launch the port first (Rendezvous::connect). A chief whose scheme hosts no
  // store (one process; ps said so above) says so once attached, and the launcher starts the others.
  s.strategy->attach(s.model, *s.optimizer);
  if (s.strategyState) {
    try {
      s.strategy->loadState(*s.strategyState);
    } catch (const CommError&) {
      throw;
    } catch (const std::exception& e) {
      const std::string what = e.what();
      throw IoError(s.strategyStateSource + ": the scheme's state in the checkpoint does not fit: " +
                    what.substr(0, what.find('\n')));
    }
    s.strategyState.reset();
  }
  if (s.cluster.isChief()) launcher::tellNoPort();
  if (std::optional<int64_t> at = s.strategy->resumeStep(); at && *at > 0) {
    const int64_t perEpoch = s.sampler->batchesPerEpoch(o.batch);
    s.step = *at;
    s.epoch = perEpoch > 0 ? *at / perEpoch : 0;
    s.stepInEpoch = perEpoch > 0 ? *at % perEpoch : 0;
    if (s.replica.isChief() || o.restartCount > 0) {  // a restarted worker says where it rejoins
      std::fprintf(stderr, "cohort: resumed from the parameter servers at step %lld\n", (long long)s.step);
    }
  }
  if (s.replica.isChief()) {
    s.metrics = std::make_unique<MetricsWriter>(o.metricsPath, o.resume || o.restartCount > 0);
    if (!o.tensorboardDir.empty()) s.board = std::make_unique<TensorBoardWriter>(o.tensorboardDir);
  }
}

Trainer::~Trainer() = default;

torch::nn::Sequential Trainer::model() const { return state_->model; }

bool Trainer::isChief() const { return state_->replica.isChief(); }

// previousLoss: NaN at the first step of the run.
// The loss of `step` is computed with the parameters the steps before it made: when the one before
// was finite and ordinary, the non-finite values came with the last update, which under a
// distributed scheme holds the other workers' gradients or parameters too.
std::string Trainer::nonFiniteLossCause(double loss, int64_t step, double previousLoss) const {
  const State& s = *state_;
  std::ostringstream out;
  out << "the loss became " << loss << " at step " << step << " on rank " << s.replica.rank;
  if (std::isnan(previousLoss)) {  // the first step of this run
    out << " (the first step of this run: the data or the parameters it started from are not finite"
        << (s.replica.worldSize > 1 ? ", or another worker's were" : "") << ")";
  } else if (s.replica.worldSize > 1 && std::isfinite(previousLoss) && std::abs(previousLoss) < kDivergingLoss) {
    out << " after a finite loss of " << previousLoss << " at step " << step - 1
        << ": the last update (which holds the other workers' contributions under --strategy "
        << schemeName(s.options.strategy.scheme) << ") brought non-finite values; the first rank to report it is where they began"
        << ", else lower --lr";
  } else {
    out << " (" << previousLoss << " at step " << step - 1 << "): training diverged; lower --lr";
  }
  return out.str();
}

TrainResult Trainer::run() {
  State& s = *state_;
  const TrainOptions& o = s.options;
  const bool chief = s.replica.isChief();
  const int64_t perEpoch = s.sampler->batchesPerEpoch(o.batch);
  const int64_t totalSteps = o.steps > 0 ? o.steps : o.epochs * perEpoch;
  const LossFn loss = o.loss ? o.loss : LossFn(crossEntropy);
  const bool serverCheckpoints = s.checkpointPlan.keptByScheme;

  Progress::Style style = Progress::Style::kOff;
  if (chief) {
    switch (o.progress) {
      case ProgressMode::kAuto: style = Progress::autoStyle(); break;
      case ProgressMode::kBar: style = Progress::Style::kBar; break;
      case ProgressMode::kLines: style = Progress::Style::kLines; break;
      case ProgressMode::kOff: break;
    }
  }
  Progress progress(style, totalSteps, o.progressIntervalSeconds);

  TrainResult result;
  const auto start = Clock::now();
  const int64_t firstStep = s.step;
  double steadySeconds = 0;
  int64_t steadySamples = 0;
  double allSeconds = 0;  // for runs too short to have a steady state
  int64_t allSamples = 0;
  double recentLoss = 0;
  bool stop = false;
  std::optional<State::Eval> lastEval;

  auto evalOnChief = [&]() {
    auto ev = s.evaluate();
    result.testAccuracy = ev.test.accuracy;
    result.testLoss = ev.test.loss;
    lastEval = ev;
    const double wall = secondsSince(start);
    MetricFields fields{{"step", s.step}, {"epoch", s.epoch}};
    MetricFields scores = scoreFields("", ev.test, false);
    fields.insert(fields.end(), scores.begin(), scores.end());
    if (ev.validation) {
      result.validationAccuracy = ev.validation->accuracy;
      result.validationLoss = ev.validation->loss;
      MetricFields v = scoreFields("val_", *ev.validation, false);
      fields.insert(fields.end(), v.begin(), v.end());
    }
    fields.emplace_back("wall_s", wall);
    if (o.targetAccuracy > 0 && ev.test.accuracy >= o.targetAccuracy && !result.secondsToTarget) {
      result.secondsToTarget = wall;
      fields.emplace_back("seconds_to_target", wall);
      stop = true;
    }
    if (o.maxSeconds > 0 && wall >= o.maxSeconds) stop = true;  // the time budget is spent
    fields.emplace_back("epoch_progress", double(s.step) / double(perEpoch));
    s.metrics->write("eval", fields);
    if (s.board) {
      std::vector<std::pair<std::string, float>> scalars{{"test/accuracy", float(ev.test.accuracy)},
                                                         {"test/loss", float(ev.test.loss)},
                                                         {"test/macro_f1", float(ev.test.macroF1)}};
      if (ev.validation) {
        scalars.emplace_back("validation/accuracy", float(ev.validation->accuracy));
        scalars.emplace_back("validation/loss", float(ev.validation->loss));
      }
      s.board->scalars(s.step, scalars);
    }
    char text[200];
    if (ev.validation) {
      std::snprintf(text, sizeof(text), "eval at step %lld: test accuracy %.4f, loss %.4f; validation accuracy %.4f",
                    (long long)s.step, ev.test.accuracy, ev.test.loss, ev.validation->accuracy);
    } else {
      std::snprintf(text, sizeof(text), "eval at step %lld: test accuracy %.4f, loss %.4f", (long long)s.step,
                    ev.test.accuracy, ev.test.loss);
    }
    progress.message(text);
  };

  // Every rank calls this at the same steps: synchronize() may be collective, and the chief's
  // decision to stop is sent to all.
  auto runEval = [&]() {
    if (s.evaluators > 0) {  // the evaluator task evaluates the checkpoint; no rank pauses for it
      s.saveCheckpoint(/*final=*/false);
      return;
    }
    s.strategy->synchronize();
    if (chief) {
      evalOnChief();
    } else if (s.strategy->joinsEvaluation()) {
      s.evaluate();
    }
    if (s.comm && (o.targetAccuracy > 0 || o.maxSeconds > 0)) {
      auto flag = torch::tensor({stop ? 1 : 0}, torch::kInt32);
      s.comm->broadcast(flag, 0);
      stop = flag.item<int>() != 0;
    } else if (stop && chief) {
      s.strategy->requestStop();  // ps, gossip: the others hear it with their next step
    }
  };

  // What the step about to run is followed by, for schemes that fetch a sparse model's rows ahead
  // (Strategy::upcoming): the next batch, in this epoch or as the next epoch's first; none (an
  // empty batch) when no step follows, or when an evaluation or checkpoint that needs this
  // process's whole model does (synchronize() then brings all of it).
  std::vector<int64_t> nextEpochIndices;
  int64_t nextEpochOf = -1;
  auto nextBatch = [&](const std::vector<int64_t>& indices, int64_t nextBegin) -> Batch {
    const int64_t next = s.step + 1;
    if (next >= totalSteps) return {};
    const bool evalAfter = o.evalEvery > 0 && next % o.evalEvery == 0 && s.evaluators == 0 &&
                           (chief || s.strategy->joinsEvaluation());
    const bool checkpointAfter = !o.checkpointDir.empty() && !serverCheckpoints && o.checkpointEvery > 0 &&
                                 next % o.checkpointEvery == 0 && s.checkpointPlan.writes;
    if (evalAfter || checkpointAfter) return {};
    if (s.stepInEpoch + 1 < perEpoch) {
      const int64_t count = std::min(o.batch, int64_t(indices.size()) - nextBegin);
      return makeBatch(s.data.train, std::span(indices).subspan(size_t(nextBegin), size_t(count)));
    }
    if (nextEpochOf != s.epoch + 1) {
      nextEpochIndices = s.sampler->epochIndices(s.epoch + 1);
      nextEpochOf = s.epoch + 1;
    }
    const int64_t count = std::min(o.batch, int64_t(nextEpochIndices.size()));
    return makeBatch(s.data.train, std::span(nextEpochIndices).subspan(0, size_t(count)));
  };

  while (s.step < totalSteps && !stop) {
    const std::vector<int64_t> indices = s.sampler->epochIndices(s.epoch);
    const int64_t n = int64_t(indices.size());
    while (s.stepInEpoch < perEpoch && s.step < totalSteps && !stop) {
      const auto stepStart = Clock::now();
      if (o.strategy.slowRank == s.replica.rank && o.strategy.slowSeconds > 0) {  // --test-slow-worker
        std::this_thread::sleep_for(std::chrono::duration<double>(o.strategy.slowSeconds));
      }
      const int64_t begin = s.stepInEpoch * o.batch;
      const int64_t count = std::min(o.batch, n - begin);
      Batch batch = onDevice(makeBatch(s.data.train, std::span(indices).subspan(size_t(begin), size_t(count))),
                             s.device);
      if (o.testNanAtStep > 0 && s.step + 1 == o.testNanAtStep && o.restartCount == 0 &&
          batch.inputs.is_floating_point()) {  // --test-nan-at
        batch.inputs = torch::full_like(batch.inputs, std::nan(""));
      }
      if (s.strategy->readsAhead()) s.strategy->upcoming(nextBatch(indices, begin + o.batch));
      StepStats stats = s.strategy->step(batch, loss);
      ++s.step;
      ++s.stepInEpoch;
      result.bytesSent += stats.bytesSent;
      result.bytesReceived += stats.bytesReceived;
      result.commWaitSeconds += stats.commWaitSeconds;
      if (!std::isfinite(stats.loss)) {
        const bool first = s.step - 1 == firstStep;
        throw Error(nonFiniteLossCause(stats.loss, s.step, first ? std::nan("") : recentLoss));
      }
      recentLoss = stats.loss;
      if (stats.stopJob) stop = true;  // the chief reached the target accuracy
      if (o.testKillAtStep > 0 && s.step == o.testKillAtStep && o.restartCount == 0) ::raise(SIGKILL);
      const double stepSeconds = secondsSince(stepStart);
      allSeconds += stepSeconds;
      allSamples += stats.samples;
      if (s.step - firstStep > kWarmupSteps) {
        steadySeconds += stepSeconds;
        steadySamples += stats.samples;
      }
      const double rate = steadySeconds > 0 ? double(steadySamples) / steadySeconds
                                            : double(stats.samples) / stepSeconds;
      if (chief) {
        MetricFields fields{{"step", s.step}, {"epoch", s.epoch}, {"loss", stats.loss},
                            {"samples", stats.samples}, {"step_s", stepSeconds},
                            {"compute_s", stats.computeSeconds},
                            {"comm_wait_s", stats.commWaitSeconds},
                            {"bytes_sent", stats.bytesSent},
                            {"bytes_received", stats.bytesReceived},
                            {"wall_s", secondsSince(start)}};
        fields.insert(fields.end(), stats.extra.begin(), stats.extra.end());
        s.metrics->write("step", fields);
        if (s.board) s.board->scalars(s.step, boardScalars(stats, rate, o.lr));
      }
      progress.update(s.step, s.epoch, stats.loss, rate);
      const bool evalPoint = o.evalEvery > 0 && s.step % o.evalEvery == 0 && s.step < totalSteps;
      if (evalPoint) runEval();
      // Keyed on the option, not on the chief-only store: saveCheckpoint() synchronizes, which
      // may be a collective every rank must join.
      if (!o.checkpointDir.empty() && !serverCheckpoints && o.checkpointEvery > 0 && s.step % o.checkpointEvery == 0 &&
          s.step < totalSteps && !(evalPoint && s.evaluators > 0)) {
        s.saveCheckpoint(/*final=*/false);
      }
    }
    if (s.stepInEpoch >= perEpoch) {
      ++s.epoch;
      s.stepInEpoch = 0;
    }
  }
  progress.finish();

  s.strategy->finish();
  std::optional<std::string> finalCheckpointError;  // a final checkpoint that could not be written
  if (s.evaluators > 0) {
    // The last checkpoint, then the marker that tells the evaluators that no other will come;
    // the chief still evaluates the final model itself for the done event.
    finalCheckpointError = s.saveCheckpoint(/*final=*/true);
    if (s.checkpoints) {
      try {
        // No checkpoint of this step when it failed: the evaluators end with the ones there are.
        writeTrainingDone(s.checkpoints->dir(), s.step);
      } catch (const IoError& e) {
        if (!finalCheckpointError) throw;
        s.warn(e.what());  // the same full disk: the evaluators end at their --evaluator-timeout
      }
    }
    s.strategy->synchronize();
    if (chief) {
      evalOnChief();
    } else if (s.strategy->joinsEvaluation()) {
      s.evaluate();
    }
  } else {
    if (!stop) runEval();
    if (!o.checkpointDir.empty() && !serverCheckpoints) finalCheckpointError = s.saveCheckpoint(/*final=*/true);
  }
  // Under ps the shards wrote the final checkpoint when the chief said Done (in finish()).
  if (chief && serverCheckpoints && !finalCheckpointError) finalCheckpointError = s.strategy->finalCheckpointError();
  MetricFields schemeReport;
  if (chief) schemeReport = s.strategy->report();

  if (!o.saveModelPath.empty()) {
    std::string path = o.saveModelPath;
    const auto at = path.find("{rank}");
    if (at != std::string::npos) path.replace(at, 6, std::to_string(s.replica.rank));
    if (at != std::string::npos || chief) {
      saveModelFile(s.model, o.model, {s.data.channels(), s.data.height(), s.data.width(), s.data.classes}, path);
    }
  }

  result.steps = s.step;
  result.epochs = s.epoch + (s.stepInEpoch > 0 ? 1 : 0);
  result.lastTrainLoss = recentLoss;
  result.wallSeconds = secondsSince(start);
  result.samplesPerSecond = steadySeconds > 0   ? double(steadySamples) / steadySeconds
                            : allSeconds > 0 ? double(allSamples) / allSeconds
                                             : 0.0;
  if (chief) {
    MetricFields done{{"steps", result.steps},
                      {"epochs", result.epochs},
                      {"samples_per_s", result.samplesPerSecond},
                      {"test_accuracy", result.testAccuracy},
                      {"test_loss", result.testLoss},
                      {"wall_s", result.wallSeconds},
                      {"bytes_sent", result.bytesSent},
                      {"bytes_received", result.bytesReceived},
                      {"comm_wait_s", result.commWaitSeconds},
                      {"strategy", std::string(schemeName(o.strategy.scheme))},
                      {"model", o.model},
                      {"workers", int64_t(s.replica.worldSize)},
                      {"max_rss_mb", maxRssMb()},
                      {"restarts", int64_t(o.restartCount)}};
    if (result.secondsToTarget) done.emplace_back("seconds_to_target", *result.secondsToTarget);
    if (s.device.is_cuda()) {
      // The most GPU memory this run's tensors held at once (the caching allocator's peak).
      const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(s.device.index());
      done.emplace_back("cuda_peak_bytes",
                        int64_t(stats.allocated_bytes[size_t(c10::CachingAllocator::StatType::AGGREGATE)].peak));
    }
    if (s.data.attainableAccuracy >= 0) done.emplace_back("attainable_accuracy", s.data.attainableAccuracy);
    if (lastEval) {
      MetricFields scores = scoreFields("test_", lastEval->test, true);
      done.insert(done.end(), scores.begin() + 2, scores.end());  // test_accuracy and test_loss are above
      if (lastEval->validation) {
        MetricFields v = scoreFields("val_", *lastEval->validation, true);
        done.insert(done.end(), v.begin(), v.end());
      }
    }
    done.insert(done.end(), schemeReport.begin(), schemeReport.end());
    if (finalCheckpointError) done.emplace_back("final_checkpoint_error", *finalCheckpointError);
    s.metrics->write("done", done);
  }
  // After the done event: the run's result is recorded, and the job still fails, naming the disk.
  if (finalCheckpointError) {
    launcher::tellFinished();  // cohort launch ends the job with this failure instead of restarting it
    throw IoError(*finalCheckpointError);
  }
  return result;
}

}  // namespace cohort
