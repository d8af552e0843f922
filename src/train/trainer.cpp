// The Trainer's set-up: the job and its scheme, the data, the model on its device, the optimizer,
// the sampler, the checkpoints (resumed when asked), and the chief's metrics.
#include "base/compute_threads.h"
#include "base/files.h"
#include "base/launcher_channel.h"
#include "models/model_spec.h"
#include "train/evaluator.h"
#include "train/threads.h"
#include "train/trainer_internal.h"
#include <cohort/error.h>
#include <cohort/job.h>
#include <cohort/models.h>

#include <nlohmann/json.hpp>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <thread>

namespace cohort {

namespace {

namespace fs = std::filesystem;

// Threads for this process when --threads is not given: OMP_NUM_THREADS (cohort launch sets it),
// else its share of this host's cores, no more than are idle (its siblings may be running).
int defaultThreads() {
  if (const std::optional<int> share = ompNumThreadsFromEnvironment()) return *share;
  int local = 1;
  try {
    local = std::max(1, resolveClusterFromEnvironment().localWorldSize);
  } catch (const Error&) {
    // reported when the trainer resolves the cluster
  }
  return defaultComputeThreadsBeside(local);
}

// The scheme is the factory's business; the Trainer gives it the run's options it needs.
StrategyOptions strategyOptions(const TrainOptions& o) {
  StrategyOptions so = o.strategy;
  so.checkpointDir = o.checkpointDir;
  so.resume = o.resume;
  so.ps.optimizer = psOptimizer(o.optimizer);
  so.ps.lr = o.lr;
  so.ps.momentum = o.momentum;
  so.ps.checkpointEvery = o.checkpointEvery;
  so.ps.resume = o.resume || o.restartCount > 0;  // a restarted worker takes up its clock on the shards
  so.gossip.authToken = o.strategy.ps.authToken;
  so.gossip.seed = o.seed;
  return so;
}

// A resumed run goes on from its checkpoint's step: the metrics file's lines past that step (the
// ones the crash undid, which the run writes again), an earlier run's done event and a line a
// kill cut off go, so that every step is there once. Only a regular file is rewritten.
void keepMetricsUpTo(const std::string& path, int64_t step) {
  std::error_code ec;
  if (!fs::is_regular_file(path, ec)) return;
  std::ifstream in(path);
  std::string kept, line;
  int64_t dropped = 0;
  while (std::getline(in, line)) {
    const nlohmann::json j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    const bool keep = j.is_object() && j.value("event", "") != "done" &&
                      (!j.contains("step") || (j["step"].is_number_integer() && j["step"].get<int64_t>() <= step));
    if (keep) {
      kept += line + "\n";
    } else {
      ++dropped;
    }
  }
  COHORT_CHECK(!in.bad(), IoError, path, ": cannot read the metrics file to resume it");
  if (dropped == 0) return;
  replaceFileWithText(path, kept);
  std::fprintf(stderr, "cohort: --metrics %s: %lld lines past step %lld dropped (the run writes them again)\n",
               path.c_str(), (long long)dropped, (long long)step);
}

}  // namespace

Trainer::Trainer(TrainOptions options) : state_(std::make_unique<State>()) {
  validate(options);
  State& s = *state_;
  s.options = std::move(options);
  const TrainOptions& o = s.options;
  setComputeThreads(o.threads > 0 ? o.threads : defaultThreads());
  torch::manual_seed(o.seed);
  s.joinJob();
  s.loadTrainingData();
  s.buildModel();
  s.placeModel();
  s.makeSampler();
  s.planCheckpoints();
  if (o.resume && !s.checkpointPlan.keptByScheme) s.resume();
  s.attachStrategy();
  s.openChiefOutputs();
}

Trainer::~Trainer() = default;

torch::nn::Sequential Trainer::model() const { return state_->model; }

bool Trainer::isChief() const { return state_->replica.isChief(); }

void Trainer::State::warn(const std::string& message) {
  std::fprintf(stderr, "cohort: warning: %s\n", message.c_str());
}

// This worker's cluster, its job and the strategy that trains over it.
void Trainer::State::joinJob() {
  const TrainOptions& o = options;
  cluster = resolveClusterFromEnvironment();
  COHORT_CHECK(cluster.role == Role::kWorker, InvalidArgument, "this process is not a worker (", describe(cluster),
               "): cohort train runs workers only");
  const Job job = Job::fromSpec(
      cluster, {.timeout = std::chrono::milliseconds(int64_t(o.timeoutSeconds * 1000)), .backend = o.backend});
  strategy = makeStrategy(strategyOptions(o), job);
  comm = strategy->communicator();
  replica = strategy->replica();
  // A ps chief hosts no store: cohort launch may start the other workers now, while this one loads
  // the data and sends the shards their Init (they wait for it at the shards). Said once attached,
  // as for the schemes below, the others began ~1.3 s after the chief on the cnn, and the chief's
  // first ~20 steps ran alone, which bench/ps.py's rate counted (docs/BENCHMARKS.md).
  if (cluster.isChief() && strategy->scheme() == Scheme::kPs) launcher::tellNoPort();
}

// --data, with --validation's examples held out.
void Trainer::State::loadTrainingData() {
  const TrainOptions& o = options;
  data = loadData(o.data, o.seed);
  holdOutValidation(data, o.validation, o.validationSeed);
  // A larger batch would silently be the whole training set, every step.
  COHORT_CHECK(o.batch <= data.train.size(), InvalidArgument, "--batch ", o.batch, " is larger than the ",
               data.train.size(), " training examples of --data ", o.data, ": use --batch of at most ",
               data.train.size());
}

// A TorchScript model (--model FILE.pt) gives a score per class for each example: one of other
// outputs failed at its first step with torch's "Target 5 is out of bounds". Checked on two
// examples in eval mode (no BatchNorm statistics move).
void Trainer::State::checkModelOutputs(const TrainOptions& o, const Batch& sample, int64_t classes) {
  torch::NoGradGuard noGrad;
  model->eval();
  const int64_t n = std::min<int64_t>(2, sample.size());
  const torch::Tensor out = model->forward(sample.inputs.narrow(0, 0, n));
  model->train();
  COHORT_CHECK(out.dim() == 2 && out.size(0) == n && out.size(1) == classes, InvalidArgument, "--model ", o.model,
               " gives outputs of shape ", out.sizes(), " for ", n, " examples, and --data ", o.data, " has ", classes,
               " classes: its last layer must give one score per class ([batch, ", classes, "])");
}

// --model for the data's shape, and the part of it this process trains (Strategy::localModel).
void Trainer::State::buildModel() {
  const TrainOptions& o = options;
  model = makeModel(o.model, inputShapeOf(data));
  if (data.bags()) {
    COHORT_CHECK(o.saveModelPath.empty(), InvalidArgument, "--save-model: a model of bags of ids (--data ", o.data,
                 ") cannot be written as a model file yet (it has no place for the table's rows); "
                 "--checkpoint-dir keeps its parameters");
    if (replica.isChief() && data.attainableAccuracy >= 0) {
      std::fprintf(stderr,
                   "cohort: %s: %lld examples; the hidden model's test accuracy (the attainable optimum) is %.4f\n",
                   data.name.c_str(), (long long)data.train.size(), data.attainableAccuracy);
    }
  }
  model->train();
  COHORT_CHECK(data.train.size() > 0, InvalidArgument, "the training set is empty");
  std::vector<int64_t> first(size_t(std::min(o.batch, data.train.size())));
  std::iota(first.begin(), first.end(), 0);
  const Batch sample = makeBatch(data.train, first);
  if (isModelFileSpec(o.model) && !o.loss) checkModelOutputs(o, sample, data.classes);
  model = strategy->localModel(model, sample);
}

// The model on its device, then its optimizer (whose state follows the parameters).
void Trainer::State::placeModel() {
  const TrainOptions& o = options;
  device = chooseDevice(o, *strategy, *model, cluster.localRank);
  checkBackend(o, *strategy, *model, device);
  if (!device.is_cpu()) model->to(device);  // before the optimizer: its state follows the parameters
  checkModelForRun(o, *model, device);
  optimizer = makeOptimizer(o.optimizer, o.lr, o.momentum, *model);
}

// The order of this process's share of the training set, epoch by epoch.
void Trainer::State::makeSampler() {
  const DataShard shard = strategy->dataShard();
  sampler = std::make_unique<ShardSampler>(SamplerOptions{
      .datasetSize = data.train.size(), .rank = shard.index, .worldSize = shard.count, .seed = options.seed});
  COHORT_CHECK(sampler->samplesPerRank() > 0, InvalidArgument, "the training set is empty");
  // As for one process (loadTrainingData): a batch beyond this process's share would silently be
  // the whole share, every step.
  COHORT_CHECK(options.batch <= sampler->samplesPerRank(), InvalidArgument, "--batch ", options.batch,
               " is larger than this process's share of the training set (", sampler->samplesPerRank(), " of ",
               data.train.size(), " examples over ", shard.count, " data-parallel processes): use --batch of at most ",
               sampler->samplesPerRank(), ", or more data");
}

// Who writes checkpoints where, and what the evaluator tasks of the cluster need of them.
void Trainer::State::planCheckpoints() {
  const TrainOptions& o = options;
  // The chief (pipeline: each stage of replica 0) reads and writes checkpoints; under ps the
  // shards checkpoint the parameters.
  checkpointPlan = strategy->checkpointPlan();
  if (!o.checkpointDir.empty() && checkpointPlan.writes && !checkpointPlan.keptByScheme) {
    const std::string dir =
        checkpointPlan.subdir.empty() ? o.checkpointDir : o.checkpointDir + "/" + checkpointPlan.subdir;
    checkpoints = std::make_unique<CheckpointStore>(dir);
    // A new run among an earlier run's checkpoints would have its own pruned as they are written
    // (the newest steps are kept), and a later --resume would take up the earlier run.
    if (!o.resume && o.restartCount == 0) {
      if (const std::vector<CheckpointFile> earlier = checkpoints->list(); !earlier.empty()) {
        throw InvalidArgument("--checkpoint-dir " + dir + " holds checkpoints of an earlier run (the newest " +
                              earlier.front().path + ", step " + std::to_string(earlier.front().step) +
                              "): --resume goes on from them; a new run needs another --checkpoint-dir, or remove "
                              "them first");
      }
    }
  }
  // The end-of-training marker is written by every chief that writes checkpoints: an evaluator the
  // cluster does not list (TF_CONFIG may leave it out) stops on it too.
  if (checkpoints) removeTrainingDone(checkpoints->dir());  // an earlier run's (its job's evaluators ignore it anyway)
  evaluators = int(cluster.evaluators.size());
  if (evaluators == 0) return;
  COHORT_CHECK(!o.checkpointDir.empty(), InvalidArgument,
               "the cluster has an evaluator task, which evaluates "
               "the checkpoints the chief writes, but no --checkpoint-dir was given: give one to every task");
  // Every process of a part's group checks (pipeline: stage-N/, tensor: way-N/): the evaluator
  // looks in --checkpoint-dir itself, and would wait out its --evaluator-timeout for nothing.
  COHORT_CHECK(
      (checkpoints != nullptr || !replica.isChief()) && checkpointPlan.subdir.empty() && !checkpointPlan.keptByScheme,
      InvalidArgument, "--strategy ", schemeName(o.strategy.scheme),
      " does not write whole-model checkpoints, which an evaluator task reads: drop the evaluator task");
  COHORT_CHECK(o.targetAccuracy == 0, InvalidArgument,
               "--target-accuracy needs the chief's own evaluation, and "
               "the cluster has an evaluator task: drop one of them");
  if (checkpoints) {
    const std::string dir = checkpoints->dir();
    const int count = evaluators;
    checkpoints->keepUnread([dir, count] { return evaluatedByAll(dir, count); });
  }
}

// attach after resume: it makes every replica start from the chief's (restored) parameters.
// Gossip binds its store when it attaches the model, blocking until its peers have joined: the
// chief tells cohort launch the port first (Rendezvous::connect). A chief whose scheme hosts no
// store (one process; ps said so above) says so once attached, and the launcher starts the others.
void Trainer::State::attachStrategy() {
  if (step > 0) strategy->resumeAt(step);
  strategy->attach(model, *optimizer);
  if (strategyState) {
    try {
      strategy->loadState(*strategyState);
    } catch (const CommError&) {
      throw;
    } catch (const std::exception& e) {
      const std::string what = e.what();
      throw IoError(strategyStateSource +
                    ": the scheme's state in the checkpoint does not fit: " + what.substr(0, what.find('\n')));
    }
    strategyState.reset();
  }
  if (cluster.isChief()) launcher::tellNoPort();
  // Under ps a resumed or restarted worker takes up its clock on the shards.
  if (std::optional<int64_t> at = strategy->resumeStep(); at && *at > 0) {
    const int64_t perEpoch = sampler->batchesPerEpoch(options.batch);
    step = *at;
    epoch = perEpoch > 0 ? *at / perEpoch : 0;
    stepInEpoch = perEpoch > 0 ? *at % perEpoch : 0;
    if (replica.isChief() || options.restartCount > 0) {  // a restarted worker says where it rejoins
      std::fprintf(stderr, "cohort: resumed from the parameter servers at step %lld\n", (long long)step);
    }
  }
}

// The chief's metrics file and TensorBoard events (a resumed or restarted run appends, after the
// lines of its checkpoint's steps).
void Trainer::State::openChiefOutputs() {
  if (!replica.isChief()) return;
  const TrainOptions& o = options;
  const bool append = o.resume || o.restartCount > 0;
  if (append && !o.metricsPath.empty()) keepMetricsUpTo(o.metricsPath, step);
  metrics = std::make_unique<MetricsWriter>(o.metricsPath, append);
  if (!o.tensorboardDir.empty()) {
    board = std::make_unique<TensorBoardWriter>(o.tensorboardDir);
    if (append) board->sessionStart(step + 1);  // the earlier files' steps after the checkpoint's go
  }
}

}  // namespace cohort
