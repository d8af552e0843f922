// Trainer::run: the training loop. Epochs of steps on this process's share of the data, the
// evaluations and checkpoints the options put between them (at the same steps on every rank), then
// the end of the run: the last evaluation and checkpoint, the saved model and the chief's done
// event.
#include "base/clock.h"
#include "base/launcher_channel.h"
#include "train/evaluator.h"
#include "train/model_file.h"
#include "train/progress.h"
#include "train/step_profiler.h"
#include "train/trainer_internal.h"
#include <cohort/autocast.h>
#include <cohort/error.h>

#include <c10/cuda/CUDACachingAllocator.h>

#include <sys/resource.h>

#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <sstream>
#include <thread>

namespace cohort {

namespace {

// Steps at the start of a run that the throughput figure leaves out (allocator and JIT warm-up).
constexpr int64_t kWarmupSteps = 5;
// A loss above this before one that is not finite is called divergence.
constexpr double kDivergingLoss = 1e4;

torch::Tensor crossEntropy(const torch::Tensor& output, const torch::Tensor& target) {
  return torch::nn::functional::cross_entropy(output, target);
}

// This process's peak resident memory so far.
double maxRssMb() {
  struct rusage usage {};
  ::getrusage(RUSAGE_SELF, &usage);
  return double(usage.ru_maxrss) / 1024.0;
}

// The progress display: the chief's, in the style --progress asks for; none on the other ranks.
Progress::Style progressStyle(ProgressMode mode, bool chief) {
  if (!chief) return Progress::Style::kOff;
  switch (mode) {
    case ProgressMode::kAuto: return Progress::autoStyle();
    case ProgressMode::kBar: return Progress::Style::kBar;
    case ProgressMode::kLines: return Progress::Style::kLines;
    case ProgressMode::kOff: break;
  }
  return Progress::Style::kOff;
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

// Samples per second: of the steady state (the steps after the warm-up), and of every step for
// runs too short to have one. Evaluation and checkpoints are not counted.
struct Throughput {
  double steadySeconds = 0;
  int64_t steadySamples = 0;
  double allSeconds = 0;
  int64_t allSamples = 0;

  // Counts a step; returns the rate to show now: the steady state's, else this step's.
  double add(double seconds, int64_t samples, bool steady) {
    allSeconds += seconds;
    allSamples += samples;
    if (steady) {
      steadySeconds += seconds;
      steadySamples += samples;
    }
    return steadySeconds > 0 ? double(steadySamples) / steadySeconds : double(samples) / seconds;
  }

  double samplesPerSecond() const {
    return steadySeconds > 0 ? double(steadySamples) / steadySeconds
           : allSeconds > 0  ? double(allSamples) / allSeconds
                             : 0.0;
  }
};

}  // namespace

// A training batch on `device`: its inputs and its targets. (Beside the tensor's, not in the
// anonymous namespace, whose name would hide it.)
static Batch onDevice(Batch batch, const c10::Device& device) {
  batch.inputs = onDevice(batch.inputs, device);
  batch.targets = onDevice(batch.targets, device);
  return batch;
}

// One call of Trainer::run: the loop's own state (the figures, the stop decision, the progress
// display) over the Trainer's.
class Trainer::State::Loop {
 public:
  explicit Loop(const Trainer& trainer)
      : trainer_(trainer),
        s_(*trainer.state_),
        o_(s_.options),
        chief_(s_.replica.isChief()),
        perEpoch_(s_.sampler->batchesPerEpoch(o_.batch)),
        totalSteps_(o_.steps > 0 ? o_.steps : o_.epochs * perEpoch_),
        loss_(o_.loss ? o_.loss : LossFn(crossEntropy)),
        serverCheckpoints_(s_.checkpointPlan.keptByScheme),
        progress_(progressStyle(o_.progress, chief_), totalSteps_, o_.progressIntervalSeconds, s_.step),
        profiler_(o_.profile, s_.device, s_.cluster.rank, s_.cluster.worldSize),
        start_(s_.startClock()),
        firstStep_(s_.step) {}

  TrainResult run() {
    while (s_.step < totalSteps_ && !stop_) trainEpoch();
    endProfile([&] { return profiler_.finish(); });  // the run ended inside the window
    if (profiler_.enabled() && !profiler_.started() && chief_) {
      s_.warn("--profile: no step of this run (steps " + std::to_string(firstStep_ + 1) + " to " +
              std::to_string(s_.step) + ") is in --profile-steps " + std::to_string(o_.profile.first) + ":" +
              std::to_string(o_.profile.last) + ": no trace was written");
    }
    progress_.finish();
    s_.strategy->finish();
    const std::optional<std::string> finalCheckpointError = evaluateAndCheckpointAtEnd();
    MetricFields schemeReport;
    if (chief_) schemeReport = s_.strategy->report();
    saveModel();
    // Exchanges outside the steps (average: the averages of the evaluations, checkpoints and end).
    const StepStats offStep = s_.strategy->offStepStats();
    result_.bytesSent += offStep.bytesSent;
    result_.bytesReceived += offStep.bytesReceived;
    result_.commWaitSeconds += offStep.commWaitSeconds;
    result_.steps = s_.step;
    result_.epochs = s_.epoch + (s_.stepInEpoch > 0 ? 1 : 0);
    result_.lastTrainLoss = recentLoss_;
    result_.wallSeconds = secondsSince(start_);
    result_.samplesPerSecond = throughput_.samplesPerSecond();
    if (chief_) writeDoneEvent(schemeReport, finalCheckpointError);
    // After the done event: the run's result is recorded, and the job still fails, naming the disk.
    if (finalCheckpointError) {
      launcher::tellFinished();  // cohort launch ends the job with this failure instead of restarting it
      throw IoError(*finalCheckpointError);
    }
    return result_;
  }

 private:
  // The rest of the epoch under way, until the run's last step or a stop.
  void trainEpoch() {
    const std::vector<int64_t> indices = s_.sampler->epochIndices(s_.epoch);
    while (s_.stepInEpoch < perEpoch_ && s_.step < totalSteps_ && !stop_) trainStep(indices);
    if (s_.stepInEpoch >= perEpoch_) {
      ++s_.epoch;
      s_.stepInEpoch = 0;
    }
  }

  // One step on the next batch of the epoch's `indices`, its figures, and the evaluation and
  // checkpoint that the options put after it.
  void trainStep(const std::vector<int64_t>& indices) {
    profiler_.beforeStep(s_.step + 1);  // not timed, as the trace's writing after the last is not
    const auto stepStart = Clock::now();
    if (o_.strategy.slowRank == s_.replica.rank && o_.strategy.slowSeconds > 0) {  // --test-slow-worker
      std::this_thread::sleep_for(std::chrono::duration<double>(o_.strategy.slowSeconds));
    }
    const int64_t begin = s_.stepInEpoch * o_.batch;
    const Batch batch = batchAt(indices, begin);
    if (s_.strategy->readsAhead()) s_.strategy->upcoming(nextBatch(indices, begin + o_.batch));
    const StepStats stats = s_.strategy->step(batch, loss_);
    ++s_.step;
    ++s_.stepInEpoch;
    countStep(stats);
    if (o_.testKillAtStep > 0 && s_.step == o_.testKillAtStep && o_.restartCount == 0) ::raise(SIGKILL);
    const double stepSeconds = secondsSince(stepStart);
    // The profiled steps run slower: they are not the steady state's.
    const bool steady = s_.step - firstStep_ > kWarmupSteps && !profiler_.profiles(s_.step);
    const double rate = throughput_.add(stepSeconds, stats.samples, steady);
    if (chief_) recordStep(stats, stepSeconds, rate);
    endProfile([&] { return profiler_.afterStep(s_.step); });
    progress_.update(s_.step, s_.epoch, stats.loss, rate);
    const bool evalPoint = evaluatesAfter(s_.step) && s_.step < totalSteps_;
    if (evalPoint) evaluateAtPoint();
    // Keyed on the option, not on the chief-only store: saveCheckpoint() synchronizes, which
    // may be a collective every rank must join.
    if (checkpointsAfter(s_.step) && s_.step < totalSteps_ && !(evalPoint && s_.evaluators > 0)) {
      s_.saveCheckpoint(/*final=*/false);
    }
  }

  // The batch of the epoch's `indices` from `begin`, on the model's device.
  Batch batchAt(const std::vector<int64_t>& indices, int64_t begin) const {
    const int64_t count = std::min(o_.batch, int64_t(indices.size()) - begin);
    Batch batch =
        onDevice(makeBatch(s_.data.train, std::span(indices).subspan(size_t(begin), size_t(count))), s_.device);
    if (o_.testNanAtStep > 0 && s_.step + 1 == o_.testNanAtStep && o_.restartCount == 0 &&
        batch.inputs.is_floating_point()) {  // --test-nan-at
      batch.inputs = torch::full_like(batch.inputs, std::nan(""));
    }
    return batch;
  }

  // --eval-every and --checkpoint-every: whether they fall after `step`.
  bool evaluatesAfter(int64_t step) const { return o_.evalEvery > 0 && step % o_.evalEvery == 0; }
  bool checkpointsAfter(int64_t step) const {
    return !o_.checkpointDir.empty() && !serverCheckpoints_ && o_.checkpointEvery > 0 && step % o_.checkpointEvery == 0;
  }

  // What the step about to run is followed by, for schemes that fetch a sparse model's rows ahead
  // (Strategy::upcoming): the next batch, in this epoch or as the next epoch's first; none (an
  // empty batch) when no step follows, or when an evaluation or checkpoint that needs this
  // process's whole model does (synchronize() then brings all of it).
  Batch nextBatch(const std::vector<int64_t>& indices, int64_t nextBegin) {
    const int64_t next = s_.step + 1;
    if (next >= totalSteps_) return {};
    const bool evalAfter = evaluatesAfter(next) && s_.evaluators == 0 && (chief_ || s_.strategy->joinsEvaluation());
    const bool checkpointAfter = checkpointsAfter(next) && s_.checkpointPlan.writes;
    if (evalAfter || checkpointAfter) return {};
    if (s_.stepInEpoch + 1 < perEpoch_) {
      const int64_t count = std::min(o_.batch, int64_t(indices.size()) - nextBegin);
      return makeBatch(s_.data.train, std::span(indices).subspan(size_t(nextBegin), size_t(count)));
    }
    if (nextEpochOf_ != s_.epoch + 1) {
      nextEpochIndices_ = s_.sampler->epochIndices(s_.epoch + 1);
      nextEpochOf_ = s_.epoch + 1;
    }
    const int64_t count = std::min(o_.batch, int64_t(nextEpochIndices_.size()));
    return makeBatch(s_.data.train, std::span(nextEpochIndices_).subspan(0, size_t(count)));
  }

  // The step's traffic into the result; a loss that is not finite ends the run, naming its cause.
  void countStep(const StepStats& stats) {
    result_.bytesSent += stats.bytesSent;
    result_.bytesReceived += stats.bytesReceived;
    result_.commWaitSeconds += stats.commWaitSeconds;
    if (!std::isfinite(stats.loss)) {
      const bool first = s_.step - 1 == firstStep_;
      throw Error(trainer_.nonFiniteLossCause(stats.loss, s_.step, first ? std::nan("") : recentLoss_));
    }
    recentLoss_ = stats.loss;
    if (stats.stopJob) stop_ = true;  // the chief reached the target accuracy
  }

  // Ends --profile's window when `stop` does. A trace that cannot be written is a warning: the
  // training goes on (an IoError here would end the run, and cohort launch might restart it).
  template <typename Stop>
  void endProfile(Stop&& stop) {
    try {
      if (std::optional<ProfileSummary> summary = stop()) reportProfile(*summary);
    } catch (const IoError& e) {
      s_.warn(e.what());
    }
  }

  // --profile's window has ended: the chief says where its time went (the log, a profile event per
  // lane); every rank has written its trace.
  void reportProfile(const ProfileSummary& summary) {
    if (!chief_) return;
    if (o_.progress == ProgressMode::kOff) {
      std::fprintf(stderr, "%s\n", describeProfile(summary).c_str());  // a result, as the done line is
    } else {
      progress_.message(describeProfile(summary));
    }
    for (const ProfileSummary::Lane& lane : summary.lanes) {
      MetricFields fields{{"step", s_.step},           {"lane", lane.where},     {"busy_s", lane.busySeconds},
                          {"events", lane.events},     {"steps", summary.steps}, {"window_s", summary.windowSeconds},
                          {"trace", summary.tracePath}};
      if (!lane.top.empty()) {
        fields.emplace_back("top", lane.top);
        fields.emplace_back("top_s", lane.topSeconds);
      }
      s_.metrics->write("profile", fields);
    }
  }

  // The chief's step event and TensorBoard scalars.
  void recordStep(const StepStats& stats, double stepSeconds, double rate) {
    MetricFields fields{{"step", s_.step},
                        {"epoch", s_.epoch},
                        {"loss", stats.loss},
                        {"samples", stats.samples},
                        {"step_s", stepSeconds},
                        {"compute_s", stats.computeSeconds},
                        {"comm_wait_s", stats.commWaitSeconds},
                        {"bytes_sent", stats.bytesSent},
                        {"bytes_received", stats.bytesReceived},
                        {"wall_s", secondsSince(start_)}};
    fields.insert(fields.end(), stats.extra.begin(), stats.extra.end());
    // --autocast fp16: the scale after this step (halved: the step was skipped).
    if (const GradScaler* scaler = s_.strategy->scaler()) fields.emplace_back("loss_scale", scaler->currentScale());
    s_.metrics->write("step", fields);
    if (s_.board) s_.board->scalars(s_.step, boardScalars(stats, rate, o_.lr));
  }

  // An evaluation point of --eval-every. Every rank calls this at the same steps: synchronize()
  // may be collective, and the chief's decision to stop is sent to all.
  void evaluateAtPoint() {
    if (s_.evaluators > 0) {  // the evaluator task evaluates the checkpoint; no rank pauses for it
      s_.saveCheckpoint(/*final=*/false);
      if (chief_ && o_.maxSeconds > 0 && secondsSince(start_) >= o_.maxSeconds) stop_ = true;
    } else {
      s_.strategy->synchronize();
      joinEvaluation();
    }
    if (s_.comm && (o_.targetAccuracy > 0 || o_.maxSeconds > 0)) {
      auto flag = torch::tensor({stop_ ? 1 : 0}, torch::kInt32);
      s_.comm->broadcast(flag, 0);
      stop_ = flag.item<int>() != 0;
    } else if (stop_ && chief_) {
      s_.strategy->requestStop();  // ps, gossip: the others hear it with their next step
    }
  }

  // The chief evaluates and records; the processes the scheme needs for it join.
  void joinEvaluation() {
    if (chief_) {
      evaluateOnChief();
    } else if (s_.strategy->joinsEvaluation()) {
      s_.evaluate();
    }
  }

  // The chief's evaluation: its result, the eval event, and the decision to stop at
  // --target-accuracy or --max-seconds.
  void evaluateOnChief() {
    const auto evalStart = Clock::now();
    const Eval ev = s_.evaluate();
    const double evalSeconds = secondsSince(evalStart);
    lastEval_ = ev;
    result_.testAccuracy = ev.test.accuracy;
    result_.testLoss = ev.test.loss;
    if (ev.validation) {
      result_.validationAccuracy = ev.validation->accuracy;
      result_.validationLoss = ev.validation->loss;
    }
    const double wall = secondsSince(start_);
    MetricFields fields = s_.evalFields(ev);
    fields.emplace_back("wall_s", wall);
    if (o_.targetAccuracy > 0 && ev.test.accuracy >= o_.targetAccuracy && !result_.secondsToTarget) {
      result_.secondsToTarget = wall;
      fields.emplace_back("seconds_to_target", wall);
      stop_ = true;
    }
    if (o_.maxSeconds > 0 && wall >= o_.maxSeconds) stop_ = true;  // the time budget is spent
    fields.emplace_back("epoch_progress", double(s_.step) / double(perEpoch_));
    // How long scoring took, and over how many processes' slices (Strategy::evaluationGroup).
    fields.emplace_back("eval_s", evalSeconds);
    const std::shared_ptr<Communicator> group = s_.strategy->evaluationGroup();
    fields.emplace_back("scored_by", int64_t(group ? group->worldSize() : 1));
    s_.metrics->write("eval", fields);
    s_.boardEval(ev);
    progress_.message(s_.evalMessage(ev));
  }

  // The run's last evaluation and checkpoint. Returns the error of a final checkpoint that could
  // not be written.
  std::optional<std::string> evaluateAndCheckpointAtEnd() {
    std::optional<std::string> finalCheckpointError;
    if (s_.evaluators > 0) {
      // The last checkpoint, then the marker that tells the evaluators that no other will come;
      // the chief still evaluates the final model itself for the done event.
      finalCheckpointError = s_.saveCheckpoint(/*final=*/true);
      markTrainingDone(finalCheckpointError);
      s_.strategy->synchronize();
      joinEvaluation();
    } else {
      if (!stop_) evaluateAtPoint();
      if (!o_.checkpointDir.empty() && !serverCheckpoints_) {
        finalCheckpointError = s_.saveCheckpoint(/*final=*/true);
        markTrainingDone(finalCheckpointError);  // for an evaluator the cluster does not list
      }
    }
    // Under ps the shards wrote the final checkpoint when the chief said Done (in finish()).
    if (chief_ && serverCheckpoints_ && !finalCheckpointError) {
      finalCheckpointError = s_.strategy->finalCheckpointError();
    }
    return finalCheckpointError;
  }

  // The end-of-training marker for the evaluator tasks (train/evaluator.h).
  void markTrainingDone(const std::optional<std::string>& finalCheckpointError) {
    if (!s_.checkpoints) return;
    try {
      // No checkpoint of this step when it failed: the evaluators end with the ones there are.
      writeTrainingDone(s_.checkpoints->dir(), s_.step, trainingDoneJob(s_.cluster));
    } catch (const IoError& e) {
      if (!finalCheckpointError) throw;
      s_.warn(e.what());  // the same full disk: the evaluators end at their --evaluator-timeout
    }
  }

  // --save-model: the chief's model, or every rank's with "{rank}" in the path.
  void saveModel() {
    if (o_.saveModelPath.empty()) return;
    std::string path = o_.saveModelPath;
    const auto at = path.find("{rank}");
    if (at != std::string::npos) path.replace(at, 6, std::to_string(s_.replica.rank));
    if (at != std::string::npos || chief_) {
      const DataSplits& d = s_.data;
      saveModelFile(s_.model, o_.model, {d.channels(), d.height(), d.width(), d.classes}, path);
    }
  }

  // The chief's done event: the run's result, the last evaluation's scores and the scheme's report.
  void writeDoneEvent(const MetricFields& schemeReport, const std::optional<std::string>& finalCheckpointError) {
    const TrainResult& r = result_;
    MetricFields done{{"steps", r.steps},
                      {"epochs", r.epochs},
                      {"samples_per_s", r.samplesPerSecond},
                      {"test_accuracy", r.testAccuracy},
                      {"test_loss", r.testLoss},
                      {"wall_s", r.wallSeconds},
                      {"bytes_sent", r.bytesSent},
                      {"bytes_received", r.bytesReceived},
                      {"comm_wait_s", r.commWaitSeconds},
                      {"strategy", std::string(schemeName(o_.strategy.scheme))},
                      {"model", o_.model},
                      {"autocast", autocastName(o_.strategy.autocast)},
                      {"workers", int64_t(s_.replica.worldSize)},
                      {"max_rss_mb", maxRssMb()},
                      {"restarts", int64_t(o_.restartCount)}};
    if (r.secondsToTarget) done.emplace_back("seconds_to_target", *r.secondsToTarget);
    if (const GradScaler* scaler = s_.strategy->scaler()) {
      done.emplace_back("skipped_steps", scaler->skippedSteps());  // an inf or NaN in the unscaled gradients
      done.emplace_back("loss_scale", scaler->currentScale());
    }
    if (s_.device.is_cuda()) {
      // The most GPU memory this run's tensors held at once (the caching allocator's peak).
      const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(s_.device.index());
      done.emplace_back("cuda_peak_bytes",
                        int64_t(stats.allocated_bytes[size_t(c10::CachingAllocator::StatType::AGGREGATE)].peak));
    }
    if (s_.data.attainableAccuracy >= 0) done.emplace_back("attainable_accuracy", s_.data.attainableAccuracy);
    if (lastEval_) {
      MetricFields scores = scoreFields("test_", lastEval_->test, true);
      done.insert(done.end(), scores.begin() + 2, scores.end());  // test_accuracy and test_loss are above
      if (lastEval_->validation) {
        MetricFields v = scoreFields("val_", *lastEval_->validation, true);
        done.insert(done.end(), v.begin(), v.end());
      }
    }
    done.insert(done.end(), schemeReport.begin(), schemeReport.end());
    if (finalCheckpointError) done.emplace_back("final_checkpoint_error", *finalCheckpointError);
    s_.metrics->write("done", done);
  }

  const Trainer& trainer_;
  State& s_;
  const TrainOptions& o_;
  const bool chief_;
  const int64_t perEpoch_;
  const int64_t totalSteps_;
  const LossFn loss_;
  const bool serverCheckpoints_;  // the scheme keeps the checkpoints (ps: the shards)
  Progress progress_;
  StepProfiler profiler_;  // --profile
  const Clock::time_point start_;
  const int64_t firstStep_;  // where this run began (a resumed run: the checkpoint's step)
  TrainResult result_;
  Throughput throughput_;
  double recentLoss_ = 0;
  bool stop_ = false;
  std::optional<Eval> lastEval_;
  // The next epoch's order, made once for nextBatch() at the end of an epoch.
  std::vector<int64_t> nextEpochIndices_;
  int64_t nextEpochOf_ = -1;
};

TrainResult Trainer::run() { return State::Loop(*this).run(); }

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
        << schemeName(s.options.strategy.scheme)
        << ") brought non-finite values; the first rank to report it is where they began"
        << ", else lower --lr";
  } else {
    out << " (" << previousLoss << " at step " << step - 1 << "): training diverged; lower --lr";
  }
  return out.str();
}

}  // namespace cohort
