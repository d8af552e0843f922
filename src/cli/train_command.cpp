#include "train/evaluator.h"
#include "train/trainer.h"
#include <cohort/autocast.h>
#include <cohort/cluster.h>
#include <cohort/error.h>
#include <cohort/job.h>
#include <cohort/parameter_server.h>

#include "ps/service.h"
#include "base/launcher_channel.h"

#include "base/files.h"
#include "base/scheme.h"
#include "cli/commands.h"
#include "schemes/pipeline_plan.h"
#include "schemes/ps_policy.h"
#include "schemes/ps_shard_task.h"
#include "train/step_profiler.h"

#include <algorithm>
#include <charconv>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <limits>
#include <map>
#include <optional>
#include <sstream>

namespace cohort::cli {

namespace {

// The longest value a config key may have: the longest values are paths, and PATH_MAX is 4096. A
// longer one (megabytes of junk) is refused, and messages show only its beginning.
constexpr size_t kMaxConfigValueBytes = 4096;
constexpr size_t kEchoedBytes = 40;

// The start of a text that may be long, for a one-line message.
std::string excerpt(const std::string& text) {
  return text.size() <= kEchoedBytes ? text : text.substr(0, kEchoedBytes) + "...";
}

// A seed is a whole number in 0..2^64-1. Without this check CLI11 reads "-1" into a uint64_t as
// 2^64-1, silently.
const CLI::Validator kSeedValidator(
    [](std::string& text) -> std::string {
      uint64_t seed = 0;
      const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), seed);
      if (ec == std::errc() && end == text.data() + text.size()) return "";
      return "Value " + excerpt(text) + " is not a seed: a whole number in 0.." +
             std::to_string(std::numeric_limits<uint64_t>::max());
    },
    "SEED");

}  // namespace

std::vector<std::string> configToArgs(const CLI::App& command, const std::string& path) {
  // Read by readNamedFile: a directory would open as a stream that reads nothing, an empty config.
  std::istringstream text(readNamedFile("--config", path, "--config takes a TOML file of KEY = VALUE lines"));
  std::vector<CLI::ConfigItem> items;
  try {
    items = CLI::ConfigTOML().from_config(text);
  } catch (const CLI::Error& e) {
    throw InvalidArgument(path + ": cannot read the config file: " + e.what());
  }
  std::vector<std::string> args;
  for (const auto& item : items) {
    if (item.name == "++" || item.name == "--") continue;  // section markers
    COHORT_CHECK(item.parents.empty(), InvalidArgument, path, ": unknown key '", excerpt(item.fullname()),
                 "': sections are not used, write the keys at the top level");
    std::string flag = "--" + item.name;
    std::replace(flag.begin() + 2, flag.end(), '_', '-');
    const CLI::Option* option = command.get_option_no_throw(flag);
    COHORT_CHECK(option != nullptr && flag != "--config" && flag != "--help", InvalidArgument, path,
                 ": unknown key '", excerpt(item.name), "' (see cohort ", command.get_name(), " --help)");
    for (const std::string& input : item.inputs) {
      COHORT_CHECK(input.size() <= kMaxConfigValueBytes, InvalidArgument, path, ": key '", item.name, "' has a value of ",
                   input.size(), " bytes, more than the ", kMaxConfigValueBytes, " a value may have: '",
                   excerpt(input), "'");
    }
    if (option->get_expected_max() == 0) {  // a flag: true or false
      COHORT_CHECK(item.inputs.size() == 1 && (item.inputs[0] == "true" || item.inputs[0] == "false"),
                   InvalidArgument, path, ": key '", item.name, "' takes true or false");
      if (item.inputs[0] == "true") args.push_back(flag);
      continue;
    }
    COHORT_CHECK(item.inputs.size() == 1, InvalidArgument, path, ": key '", item.name,
                 "' takes one value");
    COHORT_CHECK(!item.inputs[0].empty(), InvalidArgument, path, ": key '", item.name,
                 "' has no value: write ", item.name, " = VALUE, or remove the line");
    args.push_back(flag);
    args.push_back(item.inputs[0]);
  }
  return args;
}

namespace {

// "a,b,,c" -> {"a", "b", "c"}
std::vector<std::string> splitList(const std::string& text) {
  std::vector<std::string> out;
  for (size_t at = 0; at < text.size();) {
    const size_t comma = std::min(text.find(',', at), text.size());
    if (comma > at) out.push_back(text.substr(at, comma - at));
    at = comma + 1;
  }
  return out;
}

// The value for `rank` in a testing flag's RANK:NUMBER[,RANK:NUMBER...] list (NUMBER >= 0), if any.
std::optional<std::string> valueForRank(const std::string& text, int rank, const char* flag, const char* form) {
  std::optional<std::string> mine;
  for (const std::string& entry : splitList(text)) {
    const size_t colon = entry.find(':');
    try {
      COHORT_CHECK(colon != std::string::npos, InvalidArgument, "");
      const int entryRank = std::stoi(entry.substr(0, colon));
      COHORT_CHECK(std::stod(entry.substr(colon + 1)) >= 0, InvalidArgument, "");
      if (entryRank == rank) mine = entry.substr(colon + 1);
    } catch (const std::exception&) {
      throw InvalidArgument(std::string(flag) + " takes " + form + "[," + form + "...], got '" + text + "'");
    }
  }
  return mine;
}

// What this run's scheme does when a worker other than the chief is lost (cli/launch_policy.h):
// the asynchronous ps modes and sync with backup workers count it lost and go on, and a restarted
// worker takes up its clock again in the asynchronous ones; gossip peers go on; every other scheme
// needs every worker at every step.
const char* workerLossOf(const StrategyOptions& s) {
  if (s.scheme == Scheme::kGossip) return "tolerated";
  if (s.scheme == Scheme::kPs && s.ps.mode != PsMode::kSync) return "rejoins";
  if (s.scheme == Scheme::kPs && s.ps.backupWorkers > 0) return "tolerated";
  return "stops-group";
}

// COHORT_RESTART_COUNT, set by `cohort launch`; 0 when absent.
int restartCountFromEnvironment() {
  const char* text = std::getenv("COHORT_RESTART_COUNT");
  if (text == nullptr || *text == '\0') return 0;
  char* end = nullptr;
  const long value = std::strtol(text, &end, 10);
  COHORT_CHECK(*end == '\0' && value >= 0 && value <= 1000000, InvalidArgument,
               "COHORT_RESTART_COUNT must be a count of restarts, got '", text, "'");
  return int(value);
}

// --bucket-mb is allreduce's and the in-memory sums' of mirrored and central (each scheme keeps its
// own default); hogwild sums nothing and mirrored/central have no small first bucket.
// --balance-shards is mirrored's and central's alone (their replicas meet at the sums).
void applyBucketOptions(StrategyOptions& s, bool bucketGiven, bool firstBucketGiven) {
  const bool inProcess = isInProcess(s.scheme);
  COHORT_CHECK(!s.inProcess.balance || s.scheme == Scheme::kMirrored || s.scheme == Scheme::kCentral, InvalidArgument,
               "--balance-shards applies to --strategy mirrored and central only, not ", schemeName(s.scheme),
               ": drop --balance-shards");
  COHORT_CHECK(!(bucketGiven && s.scheme == Scheme::kHogwild), InvalidArgument,
               "--bucket-mb does not apply to --strategy hogwild: its threads sum no gradients; drop --bucket-mb");
  COHORT_CHECK(!(firstBucketGiven && inProcess), InvalidArgument, "--first-bucket-mb does not apply to --strategy ",
               schemeName(s.scheme), ": its in-memory sums use buckets of --bucket-mb alone; drop --first-bucket-mb");
  COHORT_CHECK(!bucketGiven || s.allreduce.bucketMb > 0, InvalidArgument, "--bucket-mb must be positive, got ",
               s.allreduce.bucketMb);
  if (bucketGiven && inProcess) s.inProcess.bucketMb = s.allreduce.bucketMb;
}

// What the train command's flags fill: the Trainer's and the evaluator task's options, and the
// flags read as text, which applyFlags() turns into options once the command line is parsed.
struct TrainFlags {
  TrainOptions options;
  EvaluatorOptions evaluator;
  std::string optimizer;  // --optimizer: parseOptimizer
  std::string psMode = "async";      // --ps-mode: parsePsMode
  std::string stalenessLr = "none";  // --staleness-lr: parsePsStalenessLr
  std::string push = "gradients";    // --push: parsePsPush
  std::string backend;    // --backend: parseCommBackend
  std::string autocast = "off";  // --autocast: parseAutocast
  std::string strategy;   // --strategy: parseScheme
  std::string progress = "auto";
  std::string microBatches = "4";  // a count or auto: parseMicroBatches
  std::string schedule = "1f1b";   // --schedule: parseSchedule
  std::string partition = "auto";  // --partition: PipelinePartition
  std::string psHosts;
  std::string authTokenFile;
  std::string slowWorker;
  std::string killAt;
  std::string nanAt;
  std::string profileSteps = "6:10";  // --profile-steps: parseProfileSteps
  // Whether they were given, for the checks that depend on it.
  CLI::App* command = nullptr;  // counts every flag
  CLI::Option* bucketMb = nullptr;
  CLI::Option* firstBucketMb = nullptr;
  CLI::Option* saveModel = nullptr;
};

// What trains, on what and how: the model, the data, the steps, the optimizer, the threads and
// the device.
void addTrainingOptions(CLI::App* train, TrainFlags& f) {
  TrainOptions& o = f.options;
  train
      ->add_option("--model", o.model,
                   "mlp, mlp:WIDTH (hidden width), cnn, lstm, embed[:rows=N,dim=D,pool=sum|mean,hidden=H,sparse=1|0] "
                   "(bags of ids), or a TorchScript file FILE.pt")
      ->capture_default_str();
  train
      ->add_option(
          "--data", o.data,
          "fashion-mnist, mnist:DIR, synthetic[:N], libsvm:TRAIN[,TEST] or synthetic-bags[:N[,ROWS]] (bags of ids)")
      ->capture_default_str();
  train->add_option("--epochs", o.epochs, "Epochs to train")->capture_default_str();
  train->add_option("--steps", o.steps, "Steps to train in all (overrides --epochs)")
      ->check(CLI::Range(int64_t{1}, kMaxSteps));  // 0 would be "not given": --epochs
  train->add_option("--batch", o.batch, "Batch size per worker (pipeline: per replica)")->capture_default_str();
  train->add_option("--lr", o.lr, "Learning rate")->capture_default_str();
  f.optimizer = optimizerName(o.optimizer);  // parsed into o.optimizer by applyFlags()
  train->add_option("--optimizer", f.optimizer, "sgd, momentum, adam or adagrad (lazy on sparse embedding rows)")
      ->capture_default_str();
  train->add_option("--momentum", o.momentum, "Momentum of the momentum optimizer")->capture_default_str();
  train->add_option("--threads", o.threads, "Intra-op threads (0: the idle cores of this host, shared among its workers)")->capture_default_str();
  train
      ->add_option("--device", o.device,
                   "Where the model trains: auto (the local rank's GPU when there is one and the scheme trains on "
                   "devices, else the CPU), cpu, cuda (cuda:LOCAL_RANK mod the GPU count) or cuda:N. On a device so "
                   "far: --strategy local, allreduce (with any --codec), average, ps (the shards stay on the CPU), "
                   "gossip, pipeline, "
                   "tensor, mirrored (replica r on the r-th GPU after the model's) and central")
      ->capture_default_str();
  f.backend = commBackendName(o.backend);  // parsed into o.backend by applyFlags()
  train
      ->add_option("--backend", f.backend,
                   "What carries the workers' collectives over CUDA tensors: auto (NCCL when this build has it and "
                   "every rank has a GPU of its own, else Gloo), nccl (an error where it cannot be) or gloo (staged "
                   "through host memory). CPU tensors always go through Gloo")
      ->check(CLI::IsMember({"auto", "nccl", "gloo"}))
      ->capture_default_str();
  train
      ->add_option("--autocast", f.autocast,
                   "Mixed precision: off; bf16 (the forward pass's convolutions, linear layers and matmuls in "
                   "bfloat16, as torch.autocast; parameters, gradients, optimizer, what the workers exchange and "
                   "the evaluation stay float32; pipeline stages and tensor's ways exchange float32); or fp16 "
                   "(float16, for GPUs before Ampere, with dynamic loss scaling as torch.amp.GradScaler: local, "
                   "allreduce, average and gossip; slow on a CPU)")
      ->capture_default_str();
  train->add_option("--seed", o.seed, "Seed for initialization and data order")
      ->check(kSeedValidator)
      ->capture_default_str();
}

// When the run evaluates, when it stops before its budget, where it checkpoints, and the
// validation set it holds out.
void addEvaluationAndCheckpointOptions(CLI::App* train, TrainOptions& o) {
  train->add_option("--eval-every", o.evalEvery, "Evaluate on the test set every N steps (0: at the end)")
      ->capture_default_str();
  train->add_option("--target-accuracy", o.targetAccuracy,
                    "Stop at the first evaluation reaching this test accuracy (0: never)");
  train->add_option("--max-seconds", o.maxSeconds,
                    "Stop at the first evaluation (--eval-every) this many seconds after the start (0: never); a "
                    "resumed run's clock goes on from its checkpoint's");
  train->add_option("--checkpoint-dir", o.checkpointDir,
                    "Write checkpoints to this directory (a new run refuses one holding checkpoints: --resume)");
  train->add_option("--checkpoint-every", o.checkpointEvery,
                    "Checkpoint every N steps (0: at the end only); under --strategy ps each shard checkpoints "
                    "every N of its updates (async, ssp: every N pushes of all the workers together)");
  train->add_flag("--resume", o.resume, "Continue from the newest checkpoint in --checkpoint-dir");
  train
      ->add_option("--validation", o.validation,
                   "Hold out N training examples for model selection: eval and done events add val_accuracy, "
                   "val_loss")
      ->capture_default_str();
  train
      ->add_option("--validation-seed", o.validationSeed,
                   "Which examples --validation holds out (independent of --seed, so that trials share them)")
      ->check(kSeedValidator)
      ->capture_default_str();
}

// What the run writes: metrics, TensorBoard events, progress, the trained model; and how long an
// evaluator task waits for them.
void addOutputOptions(CLI::App* train, TrainFlags& f) {
  TrainOptions& o = f.options;
  train->add_option("--metrics", o.metricsPath, "Write JSON-lines metrics to this file");
  train->add_option("--tensorboard", o.tensorboardDir,
                    "Write TensorBoard event files (events.out.tfevents.*) to this directory (an evaluator task: "
                    "DIR/eval)");
  train
      ->add_option("--evaluator-timeout", f.evaluator.idleTimeoutSeconds,
                   "An evaluator task fails after this many seconds without a new checkpoint or the end of "
                   "training")
      ->capture_default_str();
  train->add_option("--progress", f.progress, "auto, bar, lines or off")
      ->check(CLI::IsMember({"auto", "bar", "lines", "off"}))
      ->capture_default_str();
  train->add_option("--profile", o.profile.path,
                    "Profile the --profile-steps window with the PyTorch profiler (Kineto: CPU operators, and on a GPU "
                    "every CUDA stream's kernels and copies): write its trace here (Chrome's trace format; each "
                    "rank its own when there are several, the rank before the extension: t.json -> t.rank0.json, "
                    "trace -> trace.rank0) and say where its time went, per CPU thread and per CUDA stream (the "
                    "log, profile events in --metrics)");
  train
      ->add_option("--profile-steps", f.profileSteps,
                   "FIRST:LAST, the steps --profile records, numbered from 1 (they are left out of samples/s)")
      ->capture_default_str();
  f.saveModel =
      train->add_option("--save-model", o.saveModelPath,
                        "Save the trained model here (torch::save); with {rank} in the path every rank saves");
}

// The training scheme, and how long its processes wait for one another.
void addSchemeOptions(CLI::App* train, TrainFlags& f) {
  train
      ->add_option(
          "--timeout", f.options.timeoutSeconds,
          "Seconds to wait for a peer before failing (a ps shard: from when it went silent, at most 3x this per call)")
      ->capture_default_str();
  f.strategy = schemeName(f.options.strategy.scheme);  // parsed into o.strategy.scheme by applyFlags()
  std::vector<std::string> schemes;
  for (Scheme s : allSchemes()) schemes.emplace_back(schemeName(s));
  train->add_option("--strategy", f.strategy, "The training scheme (README.md's table says what each does)")
      ->check(CLI::IsMember(schemes))
      ->capture_default_str();
}

void addDataParallelOptions(CLI::App* train, TrainFlags& f) {
  auto* dp = "Data parallelism";
  StrategyOptions& s = f.options.strategy;
  f.bucketMb =
      train
          ->add_option("--bucket-mb", s.allreduce.bucketMb,
                       "allreduce, mirrored, central: gradient bucket size in MB (default 25 for allreduce, 4 for "
                       "mirrored and central)")
          ->group(dp);
  f.firstBucketMb = train
                        ->add_option("--first-bucket-mb", s.allreduce.firstBucketMb,
                                     "allreduce: size of the first bucket, launched earliest")
                        ->group(dp)
                        ->capture_default_str();
  train
      ->add_flag_callback(
          "--no-overlap", [&s] { s.allreduce.overlap = false; },
          "allreduce, mirrored, central: launch every allreduce (mirrored, central: every in-memory sum, "
          "and mirrored's allreduce across processes) after backward instead of during it")
      ->group(dp);
  train
      ->add_flag("--balance-shards", s.inProcess.balance,
                 "mirrored, central: split each batch over the replica threads in proportion to their measured "
                 "speed (forward and backward time per example, smoothed over steps) instead of evenly, so a "
                 "replica on a slower core does not hold the others at the sums; the step still equals one on the "
                 "whole batch, but runs are no longer bit-reproducible")
      ->group(dp);
  train
      ->add_option("--period", s.average.period,
                   "average: average the parameters every K steps (and at each evaluation and checkpoint, from "
                   "which the K steps count anew)")
      ->group(dp)
      ->capture_default_str();
  train
      ->add_flag("--average-optimizer-state", s.average.averageOptimizerState,
                 "average: average momentum / Adam state too")
      ->group(dp);
  train
      ->add_option("--outer-optimizer", s.average.outerOptimizer,
                   "average: apply each averaged change with sgd, momentum or nesterov (BMUF, DiLoCo); sgd with "
                   "--outer-lr 1 is plain averaging")
      ->type_name("TEXT")
      // A name to its enum's number (which CLI11 then reads into the enum); a wrong one is told
      // the names, where CLI::CheckedTransformer would show its map to numbers.
      ->transform(CLI::Validator(
          [](std::string& value) -> std::string {
            static const std::map<std::string, AveragingOptions::Outer> names{
                {"sgd", AveragingOptions::Outer::kSgd},
                {"momentum", AveragingOptions::Outer::kMomentum},
                {"nesterov", AveragingOptions::Outer::kNesterov}};
            const auto found = names.find(value);
            if (found == names.end()) return excerpt(value) + " not in {sgd,momentum,nesterov}";
            value = std::to_string(int(found->second));
            return "";
          },
          "{sgd,momentum,nesterov}"))
      ->default_str("sgd")  // shown in --help only; the default itself is AveragingOptions'
      ->group(dp);
  train->add_option("--outer-lr", s.average.outerLr, "average: the outer optimizer's learning rate")
      ->group(dp)
      ->capture_default_str();
  train
      ->add_option("--outer-momentum", s.average.outerMomentum,
                   "average: the outer optimizer's momentum (momentum, nesterov)")
      ->group(dp)
      ->capture_default_str();
}

void addModelParallelOptions(CLI::App* train, TrainFlags& f) {
  auto* mp = "Model parallelism and replicas (pipeline, tensor; --replicas also mirrored, central, hogwild)";
  StrategyOptions& s = f.options.strategy;
  auto& pl = s.pipeline;
  train->add_option("--stages", pl.stages, "Cut the model into S stages, one per process (rank = replica*S + stage)")
      ->group(mp)
      ->capture_default_str();
  train
      ->add_option("--replicas", s.replicas,
                   "pipeline: R copies of the pipeline, data-parallel (default 1); mirrored, central, hogwild: R "
                   "replica threads in this process sharing its --batch (default: its cores, OMP_NUM_THREADS where set, "
                   "as cohort launch sets it)")
      ->check(CLI::Range(1, std::numeric_limits<int>::max()))  // 0 would be "not given": the default
      ->group(mp);
  train
      ->add_option("--ways", s.ways,
                   "tensor: split every layer's units over W processes (cohort launch -n W*R for R data-parallel "
                   "copies)")
      ->group(mp)
      ->capture_default_str();
  train
      ->add_option("--micro-batches", f.microBatches,
                   "Split each batch into M micro-batches (1 to --batch), or auto: at start, time every layer on 1 "
                   "example and on the batch, and a message between stages 0 and 1, and take the M that minimizes "
                   "the predicted step (M+S-1) x (the slowest stage's time per micro-batch + the message), which about "
                   "keeps each micro-batch's work at least M/(S-1) times its fixed cost (auto: not with a --partition "
                   "that splits a layer)")
      ->group(mp)
      ->capture_default_str();
  train
      ->add_option("--schedule", f.schedule,
                   "gpipe (all forwards, then all backwards) or 1f1b (at most S micro-batches held per stage)")
      ->check(CLI::IsMember({"gpipe", "1f1b"}))
      ->group(mp)
      ->capture_default_str();
  train
      ->add_option("--partition", f.partition,
                   "auto (balance measured forward+backward time per layer), split (as auto, and a stage may end "
                   "inside a Conv2d or Linear, taking its first output channels: balances models whose layers are "
                   "unequal), or L1,L2,... layers per stage, where L+C also gives the stage the first C output "
                   "channels of the next stage's first layer")
      ->group(mp)
      ->capture_default_str();
}

void addCompressionOptions(CLI::App* train, StrategyOptions& s) {
  auto* codecGroup = "Compression (allreduce, average, ps, gossip)";
  train
      ->add_option("--codec", s.codec,
                   "What exchanges carry: none, fp16, bf16, topk:RATIO (largest |g|, with residual), "
                   "threshold:TAU (Strom: +-TAU where the residual passes it), onebit (sign + scale, with residual). "
                   "A sparse model's rows: fp16/bf16 values under fp16/bf16, float32 under the others")
      ->group(codecGroup)
      ->capture_default_str();
  train->add_option("--codec-warmup-steps", s.codecWarmupSteps, "Train uncompressed for the first W steps")
      ->group(codecGroup)
      ->capture_default_str();
}

// The update policy and its knobs, then the shards' addresses and the job's secret and TLS.
void addParameterServerOptions(CLI::App* train, TrainFlags& f) {
  auto* psGroup = "Parameter server (--strategy ps)";
  auto& p = f.options.strategy.ps;
  train->add_option("--ps-mode", f.psMode, "sync, async, softsync or ssp")
      ->check(CLI::IsMember({"sync", "async", "softsync", "ssp"}))
      ->group(psGroup)
      ->capture_default_str();
  train
      ->add_option("--backup-workers", p.backupWorkers,
                   "sync: aggregate the first N-K gradients of each step, drop the late ones")
      ->group(psGroup)
      ->capture_default_str();
  train->add_option("--softsync", p.softsync, "softsync: apply after this many gradients, averaged")
      ->group(psGroup)
      ->capture_default_str();
  train->add_option("--staleness-bound", p.stalenessBound, "ssp: a worker more than S steps ahead of the slowest waits")
      ->group(psGroup)
      ->capture_default_str();
  train
      ->add_option("--staleness-lr", f.stalenessLr,
                   "async, softsync, ssp: none, or inverse: scale each gradient by 1/staleness")
      ->check(CLI::IsMember({"none", "inverse"}))
      ->group(psGroup)
      ->capture_default_str();
  train->add_option("--max-staleness", p.maxStaleness, "async, softsync, ssp: drop gradients staler than T (-1: never)")
      ->group(psGroup)
      ->capture_default_str();
  train
      ->add_option("--warmup-steps", p.warmupSteps,
                   "async, softsync, ssp: worker 0 trains alone for the first W updates")
      ->group(psGroup)
      ->capture_default_str();
  train->add_option("--push", f.push, "gradients (the shards run the optimizer) or updates (the workers do)")
      ->check(CLI::IsMember({"gradients", "updates"}))
      ->group(psGroup)
      ->capture_default_str();
  train
      ->add_option("--ps-push-chunk-mb", p.pushChunkMb,
                   "A float32 push to a shard of more than this many MB goes in chunks of at most this size, "
                   "which the shard checks and applies while the next arrives (a bad chunk ends the push, the "
                   "chunks before it stay applied); a smaller one, or any when 0, as one message")
      ->check(CLI::Range(0.0, 1024.0))
      ->group(psGroup)
      ->capture_default_str();
  train->add_option("--ps-hosts", f.psHosts, "Shard addresses HOST:PORT,... (default: TF_CONFIG's ps list)")
      ->group(psGroup);
  train
      ->add_option("--auth-token", p.authToken,
                   "Shared secret of the shards and gossip peers (default: $COHORT_AUTH_TOKEN)")
      ->group(psGroup);
  train->add_option("--auth-token-file", f.authTokenFile, "Read the shared secret from this file")->group(psGroup);
  train->add_option("--tls-ca", p.tlsCa, "PEM roots that sign the shards' certificates: talk TLS")->group(psGroup);
  train->add_option("--tls-cert", p.tlsCert, "A shard task's PEM certificate: serve TLS")->group(psGroup);
  train->add_option("--tls-key", p.tlsKey, "A shard task's PEM private key")->group(psGroup);
}

void addGossipOptions(CLI::App* train, StrategyOptions& s) {
  auto* gossipGroup = "Gossip (--strategy gossip)";
  train
      ->add_option("--gossip-peers", s.gossip.peers,
                   "Send each step's update to K random peers (the others get it with their next turn); 0: all")
      ->group(gossipGroup)
      ->capture_default_str();
}

// Faults on purpose, for the tests: slow workers, killed workers and evaluators, NaN inputs.
void addTestingOptions(CLI::App* train, TrainFlags& f) {
  train
      ->add_option("--test-slow-worker", f.slowWorker,
                   "Testing: RANK:SECONDS[,...] makes those workers sleep so long every step")
      ->group("Testing");
  train
      ->add_option("--test-kill-at", f.killAt,
                   "Testing: RANK:STEP[,...] makes those workers SIGKILL themselves after that step "
                   "(in their first run, not after a cohort launch --max-restarts restart)")
      ->group("Testing");
  train
      ->add_option("--test-nan-at", f.nanAt,
                   "Testing: RANK:STEP[,...] fills those workers' inputs of that step with NaN, so that their loss "
                   "and gradients become non-finite (in their first run only)")
      ->group("Testing");
  train
      ->add_option("--test-kill-evaluator-after", f.evaluator.testKillAfter,
                   "Testing: an evaluator task SIGKILLs itself right after recording its N-th checkpoint "
                   "(once: restarted, it finds N recorded and goes on)")
      ->group("Testing");
}

// --save-model's path, now rather than when the run is over. Its directory may be --checkpoint-dir,
// which the run makes; with {rank} in it, each rank's path is its own (training_loop.cpp).
void checkSaveModelPath(const TrainOptions& o) {
  namespace fs = std::filesystem;
  if (o.saveModelPath.find("{rank}") != std::string::npos) return;
  const auto asDirectory = [](const fs::path& p) { return (p / "").lexically_normal(); };
  std::error_code error;
  const bool intoCheckpointDir = !o.checkpointDir.empty() && !fs::exists(o.checkpointDir, error) &&
                                 asDirectory(fs::path(o.saveModelPath).parent_path()) == asDirectory(o.checkpointDir);
  if (!intoCheckpointDir) checkOutputPath("--save-model", o.saveModelPath);
}

// A flag given for a scheme other than the run's does nothing, and the user would not see it:
// refused, naming where it acts. (compare and sweep leave a shared one out of the runs it means
// nothing to: experiment/plan.cpp.) `--codec none` is what every run does, and passes.
void refuseFlagsOfOtherSchemes(const TrainFlags& f) {
  const Scheme scheme = f.options.strategy.scheme;
  for (const std::string& flag : schemeSpecificFlags()) {
    if (f.command->count(flag) == 0) continue;
    if (flag == "--codec" && f.options.strategy.codec == "none") continue;
    const std::optional<std::string> where = whereFlagActs(flag, scheme, f.psMode);
    if (!where) continue;
    const bool modeOnly = where->rfind("--ps-mode", 0) == 0;
    throw InvalidArgument(flag + " does not apply to " +
                          (modeOnly ? "--ps-mode " + f.psMode : "--strategy " + std::string(schemeName(scheme))) +
                          ": it acts under " + *where + " only; drop " + flag);
  }
}

// The flags read as text, turned into options and checked: a bad value is a usage error before
// anything starts.
void applyFlags(TrainFlags& f) {
  TrainOptions& o = f.options;
  o.strategy.scheme = *parseScheme(f.strategy);  // --strategy's check let only scheme names through
  o.backend = parseCommBackend(f.backend);       // so did --backend's
  const std::optional<OptimizerKind> optimizer = parseOptimizer(f.optimizer);
  COHORT_CHECK(optimizer.has_value(), InvalidArgument, "unknown optimizer '", f.optimizer,
               "': expected sgd, momentum, adam or adagrad");
  o.optimizer = *optimizer;
  // Each did nothing beside another optimizer, silently.
  COHORT_CHECK(f.command->count("--momentum") == 0 || o.optimizer == OptimizerKind::kMomentum, InvalidArgument,
               "--momentum is the momentum optimizer's, and --optimizer ", f.optimizer,
               " has none: give --optimizer momentum or drop --momentum");
  COHORT_CHECK(
      f.command->count("--outer-momentum") == 0 || o.strategy.average.outerOptimizer != AveragingOptions::Outer::kSgd,
      InvalidArgument,
      "--outer-momentum is the outer optimizer's momentum, and --outer-optimizer sgd has none: give "
      "--outer-optimizer momentum or nesterov, or drop --outer-momentum");
  o.strategy.autocast = parseAutocast(f.autocast);
  COHORT_CHECK(f.saveModel->count() == 0 || !o.saveModelPath.empty(), InvalidArgument,
               "--save-model needs a file "
               "to write the model to, got an empty path: give --save-model FILE or drop it");
  if (!o.saveModelPath.empty()) checkSaveModelPath(o);
  parseProfileSteps(f.profileSteps, o.profile);
  if (!o.profile.path.empty()) quietKinetoWithoutGpu();  // here, while this process has one thread
  checkCodecOptions(o.strategy);  // a bad --codec is a usage error before anything starts
  checkAutocastOptions(o.strategy);
  applyBucketOptions(o.strategy, f.bucketMb->count() > 0, f.firstBucketMb->count() > 0);
  refuseFlagsOfOtherSchemes(f);
  o.strategy.pipeline.microBatches =
      parseMicroBatches(f.microBatches, o.strategy.scheme == Scheme::kPipeline ? o.batch : INT64_MAX);
  o.strategy.pipeline.schedule = parseSchedule(f.schedule);  // --schedule's check let only these through
  o.strategy.pipeline.partition = PipelinePartition(f.partition);  // a bad one is a usage error here
  auto& p = o.strategy.ps;
  p.mode = *parsePsMode(f.psMode);  // the flags' checks let only these names through
  p.stalenessLr = *parsePsStalenessLr(f.stalenessLr);
  p.push = *parsePsPush(f.push);
  p.authToken = resolveAuthToken(p.authToken, f.authTokenFile);
  // The job's secret is also the rendezvous store's, which the cluster spec carries from
  // $COHORT_AUTH_TOKEN: a secret given as a flag goes there too.
  if (!p.authToken.empty()) ::setenv("COHORT_AUTH_TOKEN", p.authToken.c_str(), 1);
  p.hosts.clear();
  p.hosts = splitList(f.psHosts);
  checkShardHosts(p.hosts, "--ps-hosts");  // a bad port or a shard named twice, before anything starts
}

// The testing flags' values for this process's rank.
void applyTestingFlags(TrainFlags& f, const ClusterSpec& cluster) {
  TrainOptions& o = f.options;
  const int myRank = cluster.role == Role::kWorker ? cluster.rank : -1;
  if (auto seconds = valueForRank(f.slowWorker, myRank, "--test-slow-worker", "RANK:SECONDS")) {
    o.strategy.slowRank = myRank;
    o.strategy.slowSeconds = std::stod(*seconds);
  }
  if (auto step = valueForRank(f.killAt, myRank, "--test-kill-at", "RANK:STEP")) o.testKillAtStep = std::stoll(*step);
  if (auto step = valueForRank(f.nanAt, myRank, "--test-nan-at", "RANK:STEP")) o.testNanAtStep = std::stoll(*step);
}

ProgressMode progressMode(const std::string& name) {
  static const std::map<std::string, ProgressMode> kModes{{"auto", ProgressMode::kAuto},
                                                          {"bar", ProgressMode::kBar},
                                                          {"lines", ProgressMode::kLines},
                                                          {"off", ProgressMode::kOff}};
  return kModes.at(name);
}

// A worker's run; the chief reports the job's result.
int trainAndReport(const TrainOptions& o) {
  Trainer trainer(o);
  TrainResult r = trainer.run();
  if (!trainer.isChief()) return 0;  // the chief reports for the job
  std::printf("done: %lld steps, %lld epochs, test accuracy %.4f, test loss %.4f, %.1f samples/s, %.1f s\n",
              (long long)r.steps, (long long)r.epochs, r.testAccuracy, r.testLoss, r.samplesPerSecond, r.wallSeconds);
  if (r.validationAccuracy) {
    std::printf("validation accuracy %.4f, validation loss %.4f\n", *r.validationAccuracy, *r.validationLoss);
  }
  if (r.secondsToTarget) std::printf("target accuracy reached after %.1f s\n", *r.secondsToTarget);
  return 0;
}

// The command once its line is parsed: a worker trains, and the cluster's other tasks run the
// same command (TF's convention).
int runTrain(TrainFlags& f) {
  TrainOptions& o = f.options;
  applyFlags(f);
  const ClusterSpec cluster = resolveClusterFromEnvironment();
  applyTestingFlags(f, cluster);
  // Under TF_CONFIG (cohort launch --ps) the same command runs on the shards: serve one.
  // It binds the address TF_CONFIG gives this task, not every interface: on one machine (cohort
  // launch) that is loopback, where strangers on the network cannot reach the shard at all.
  if (cluster.role == Role::kParameterServer) {
    if (!o.checkpointDir.empty()) launcher::tellShardCheckpoints();
    const Job job = Job::fromSpec(cluster);
    return runShardProcess(shardTaskOptions(job, o.strategy.ps, o.checkpointDir));
  }
  launcher::tellFaultPolicy(workerLossOf(o.strategy));
  o.restartCount = restartCountFromEnvironment();
  // A restarted job resumes by itself.
  if (o.restartCount > 0 && !o.checkpointDir.empty()) o.resume = true;
  // An evaluator task (TF_CONFIG type "evaluator", cohort launch --evaluator) runs the same command too.
  if (cluster.role == Role::kEvaluator) return runEvaluator(o, cluster, f.evaluator);
  o.progress = progressMode(f.progress);
  return trainAndReport(o);
}

}  // namespace

Run addTrainCommand(CLI::App& app) {
  auto flags = std::make_shared<TrainFlags>();
  CLI::App* train = app.add_subcommand("train", "Train a model with one of the distribution schemes");
  flags->command = train;
  // A flag given twice (in --config and on the command line) takes the last: the command line.
  train->option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  // Read by expandConfig() before parsing; declared here for --help.
  train->add_option("--config",
                    "Read options from a TOML file: keys are the long flag names "
                    "(batch = 32, eval-every = 100); the command line overrides them");
  addTrainingOptions(train, *flags);
  addEvaluationAndCheckpointOptions(train, flags->options);
  addOutputOptions(train, *flags);
  addSchemeOptions(train, *flags);
  addDataParallelOptions(train, *flags);
  addModelParallelOptions(train, *flags);
  addCompressionOptions(train, flags->options.strategy);
  addParameterServerOptions(train, *flags);
  addGossipOptions(train, flags->options.strategy);
  addTestingOptions(train, *flags);
  return [flags]() { return runTrain(*flags); };
}

}  // namespace cohort::cli
