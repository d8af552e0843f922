// The pipeline handle (include/cohort/pipeline.h): the job's processes as stages and replicas, the
// model cut (pipeline_cut.cpp) and this stage's layers made (pipeline_split.cpp), evaluation
// through the stages, and what the stages measured, gathered. A step is in pipeline_step.cpp.
#include <cohort/checkpoint.h>
#include <cohort/error.h>
#include <cohort/pipeline.h>

#include "schemes/model_sync.h"
#include "schemes/pipeline_internal.h"
#include "schemes/pipeline_manifest.h"
#include "schemes/pipeline_split.h"

#include <algorithm>
#include <filesystem>
#include <numeric>

namespace cohort {

namespace {

constexpr const char* kWho = "cohort::Pipeline";
// What finish() gathers from each stage: peak activation bytes, then the steady steps' idle,
// step, compute, send and optimizer seconds.
constexpr int kGathered = 6;

// The job's communicator, checked against the options (stages and replicas resolved).
std::shared_ptr<Communicator> checkJob(const Job& job, PipelineOptions& options) {
  auto comm = job.communicator();
  COHORT_CHECK(comm != nullptr, InvalidArgument, kWho,
               ": the job has no communicator (one process alone): "
               "a pipeline needs a process per stage");
  const int W = comm->worldSize();
  if (options.stages == 0) options.stages = W;
  COHORT_CHECK(options.stages >= 1, InvalidArgument, kWho, ": stages must be positive, got ", options.stages);
  if (options.replicas == 0) options.replicas = std::max(1, W / options.stages);
  const int S = options.stages;
  const int R = options.replicas;
  COHORT_CHECK(S * R == W, InvalidArgument, kWho, ": ", S, " stages x ", R, " replicas need ", S * R,
               " processes, but the job has ", W);
  // The pipeline runs backward and the optimizer itself: no place for float16's loss scaling.
  COHORT_CHECK(!options.autocast || *options.autocast == c10::kBFloat16, InvalidArgument, kWho, ": autocast in ",
               *options.autocast,
               " is not taken: float16 needs loss scaling, which the pipeline's step has no place "
               "for; use bfloat16");
  COHORT_CHECK(options.microBatches >= 1 || options.microBatches == kAutoMicroBatches, InvalidArgument, kWho,
               ": microBatches must be positive or kAutoMicroBatches, got ", options.microBatches);
  COHORT_CHECK(!(options.partition.splitsALayer() && options.microBatches == kAutoMicroBatches), InvalidArgument,
               kWho, ": partition ", options.partition.text(), " splits a layer, which kAutoMicroBatches does not model");
  return comm;
}

// Throws InvalidArgument when the model cannot be cut into `stages`.
void checkLayers(const torch::nn::Sequential& model, const std::vector<std::string>& names, int stages) {
  const int L = int(names.size());
  COHORT_CHECK(!(L == 1 && model->named_children()[0].key() == "script"), InvalidArgument,
               "--strategy pipeline: the TorchScript model's top level is not an nn.Sequential, so it is one layer "
               "and cannot be cut into stages: script an nn.Sequential whose children are the layers");
  std::string list;
  for (int j = 0; j < L; ++j) list += (j ? ", " : "") + std::to_string(j) + " " + names[size_t(j)];
  COHORT_CHECK(stages <= L, InvalidArgument, "--stages ", stages, " is more than the model's ", L, " layers (", list,
               "): every stage needs at least one layer, use --stages ", L, " or fewer");
}

// Throws InvalidArgument when the stages' copies cannot average the model's gradients: a sparse
// embedding table's are its touched rows, and averageGradients (pipeline_step.cpp) averages dense
// tensors. Every process checks the whole model, so every one refuses it.
void checkReplicable(torch::nn::Sequential& model, int replicas) {
  if (replicas <= 1) return;
  for (auto& [name, p] : uniqueParameters(*model)) {
    COHORT_CHECK(!p.requires_grad() || !hasRowSparseGradient(*model, p), InvalidArgument, kWho, ": parameter ", name,
                 " is an embedding table with sparse gradients, and the ", replicas,
                 " copies of its stage average dense ones: make it dense (sparse(false); --model embed:sparse=0), "
                 "train one copy of the pipeline (--replicas 1), or use allreduce, average or ps, which exchange "
                 "the touched rows");
  }
}

// Whether `dir` holds checkpoints of a stage (stage-K/, any K): an earlier run's, when this one
// does not resume.
bool holdsStageCheckpoints(const std::string& dir) {
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind("stage-", 0) == 0 && entry.is_directory(ec) &&
        !CheckpointStore(entry.path().string()).list().empty())
      return true;
  }
  return false;
}

// What crosses between `stage` and its neighbours under the cut.
StageWire stageWire(const LayerProfile& profile, const std::vector<int>& counts, const std::vector<int>& splits,
                    int stage) {
  const int firstLayer = std::accumulate(counts.begin(), counts.begin() + stage, 0);
  const int lastLayer = firstLayer + counts[size_t(stage)] - 1;
  StageWire wire;
  if (stage > 0 && splits[size_t(stage) - 1] > 0) {
    wire.inShape = profile.packedOf(firstLayer, splits[size_t(stage) - 1]);
    wire.inType = profile.types[size_t(firstLayer)];
  } else if (stage > 0) {
    wire.inShape = profile.outputs[size_t(firstLayer) - 1];
    wire.inType = profile.types[size_t(firstLayer) - 1];
  }
  if (splits[size_t(stage)] > 0) {
    wire.outShape = profile.packedOf(lastLayer + 1, splits[size_t(stage)]);
    wire.outType = profile.types[size_t(lastLayer) + 1];
  } else {
    wire.outShape = profile.outputs[size_t(lastLayer)];
    wire.outType = profile.types[size_t(lastLayer)];
  }
  wire.modelOutShape = profile.outputs.back();
  wire.modelOutType = profile.types.back();
  return wire;
}

// The summary's fractions of replica 0's stages, from every stage's gathered figures.
void stageFractions(const std::vector<double>& gathered, int stages, PipelineSummary* out) {
  for (int s = 0; s < stages && size_t(kGathered * (s + 1)) <= gathered.size(); ++s) {
    const double* g = &gathered[size_t(kGathered * s)];
    const double step = g[2];
    auto fraction = [step](double x) { return step > 0 ? x / step : 0.0; };
    out->stagePeakActivationBytes.push_back(int64_t(g[0]));
    out->stageIdleFraction.push_back(fraction(g[1]));
    out->stageComputeFraction.push_back(fraction(g[3]));
    out->stageSendFraction.push_back(fraction(g[4]));
    out->stageOptimizerFraction.push_back(fraction(g[5]));
    out->bubbleFraction += out->stageIdleFraction.back() / stages;
  }
}

// The bubble the schedule predicts for the stages' measured compute (unequal stages included):
// with t_s a stage's compute per micro-batch, a step takes about sum(t) + (M-1) max(t), and stage
// s idles 1 - M t_s / that. Equal stages give (S-1)/(M+S-1); what the measured bubble has beyond
// this is the cost of the messages and of the waits between stages.
double expectedBubble(const std::vector<double>& compute, int microBatches) {
  if (compute.empty()) return 0;
  const double sum = std::accumulate(compute.begin(), compute.end(), 0.0);
  const double slowest = *std::max_element(compute.begin(), compute.end());
  const double M = microBatches;
  const double step = sum + (M - 1) * slowest;
  double expected = 0;
  for (double c : compute) expected += (step > 0 ? 1.0 - M * c / step : 0.0) / double(compute.size());
  return expected;
}

}  // namespace

Pipeline::Pipeline(const Job& job, torch::nn::Sequential model, const torch::Tensor& sample, PipelineOptions options)
    : impl_(std::make_unique<Impl>()) {
  Impl& p = *impl_;
  p.options = std::move(options);
  p.comm = checkJob(job, p.options);
  const int S = p.options.stages;
  p.stage = p.comm->rank() % S;
  p.replica = p.comm->rank() / S;
  std::vector<int> peers;
  for (int q = 0; q < p.options.replicas; ++q) peers.push_back(q * S + p.stage);
  p.stageGroup = p.comm->split(peers, "stage-" + std::to_string(p.stage));

  p.layerNames = layerNames(model);
  checkLayers(model, p.layerNames, S);
  checkReplicable(model, p.options.replicas);
  const LayerProfile profile = dryRun(model, sample);
  p.chooseCut(model, sample, profile);
  p.wire = stageWire(profile, p.counts, p.splits, p.stage);
  p.module = stageLayers(model, profile, p.counts, p.splits, p.stage);
  // The manifest says how the checkpoints beside it cut the model, and a resume reads it (before
  // this, in chooseCut). A new run among an earlier run's checkpoints leaves it as it is: the
  // Trainer refuses that run after this constructor, and the earlier run must still resume.
  if (p.comm->rank() == 0 && !p.options.checkpointDir.empty() &&
      (p.options.resume || !holdsStageCheckpoints(p.options.checkpointDir))) {
    writePipelineManifest(p.options.checkpointDir, {S, p.options.replicas, p.counts, p.splits}, p.layerNames);
  }
}

Pipeline::~Pipeline() = default;

torch::nn::Sequential Pipeline::module() const { return impl_->module; }
int Pipeline::stages() const { return impl_->options.stages; }
int Pipeline::stage() const { return impl_->stage; }
int Pipeline::replica() const { return impl_->replica; }
int Pipeline::replicas() const { return impl_->options.replicas; }
int Pipeline::microBatches() const { return impl_->options.microBatches; }
std::vector<int> Pipeline::cut() const { return impl_->counts; }
std::vector<int> Pipeline::splits() const { return impl_->splits; }
Job Pipeline::stageJob() const { return Job::fromCommunicator(impl_->stageGroup); }

void Pipeline::broadcastParameters() {
  if (impl_->options.replicas > 1) broadcastModel(*impl_->stageGroup, *impl_->module);
}

PipelineStepStats Pipeline::step(const torch::Tensor& inputs, const torch::Tensor& targets, const PipelineLoss& loss,
                                 torch::optim::Optimizer& optimizer) {
  return impl_->step(inputs, targets, loss, optimizer);
}

torch::Tensor Pipeline::infer(const torch::Tensor& inputs) {
  Impl& p = *impl_;
  if (p.stages() == 1) return p.module->forward(inputs);
  const int64_t n = inputs.size(0);
  // The batch size before the activations, as in a step (Impl::checkBatchOfPrevious).
  CommWork batchSend;
  if (!p.last()) batchSend = p.comm->sendAsync(torch::tensor({n}), p.nextRank(), kEvalBatchTag);
  torch::Tensor x = inputs;
  if (!p.first()) {
    p.checkBatchOfPrevious(n, kEvalBatchTag, "infer");
    x = wireBuffer(withBatch(n, p.wire.inShape), p.wire.inType, inputs.device());
    p.comm->recv(x, p.prevRank(), kEvalTag);
    x = x.to(inputs.device());
  }
  auto y = toWire(p.module->forward(x));
  p.comm->send(y, p.last() ? 0 : p.nextRank(), p.last() ? kEvalOutputTag : kEvalTag);
  batchSend.wait();
  if (!p.first()) return {};
  auto out = torch::empty(withBatch(n, p.wire.modelOutShape), torch::TensorOptions().dtype(p.wire.modelOutType));
  p.comm->recv(out, p.stages() - 1, kEvalOutputTag);
  return out;
}

void Pipeline::synchronizeBuffers() {
  impl_->lossSend.wait();
  // Buffers (BatchNorm's statistics) are updated by each replica from its own batches.
  if (impl_->options.replicas > 1) averageInPlace(*impl_->stageGroup, impl_->module->buffers());
}

PipelineSummary Pipeline::finish() {
  Impl& p = *impl_;
  p.lossSend.wait();
  const StepTimes& t = p.steady;
  auto mine = torch::tensor(
      {double(p.peakActivationBytes), t.idle, p.stepSeconds, t.forward + t.backward, t.send + t.sendWait, t.optimizer},
      torch::kFloat64);
  std::vector<double> gathered;
  for (auto& g : p.comm->allgather(mine)) {
    for (int k = 0; k < kGathered; ++k) gathered.push_back(g[k].item<double>());
  }
  const int S = p.stages();
  const int M = p.options.microBatches;
  PipelineSummary summary;
  stageFractions(gathered, S, &summary);
  summary.bubbleFractionTheory = double(S - 1) / double(M + S - 1);
  summary.bubbleFractionExpected = expectedBubble(summary.stageComputeFraction, M);
  if (p.autoChoice) {
    summary.microBatchesAuto = true;
    summary.microBatchFixedSeconds = p.autoChoice->fixedSeconds;
    summary.microBatchWorkSeconds = p.autoChoice->slotSeconds - p.autoChoice->fixedSeconds;
    summary.predictedStepSeconds = p.autoChoice->stepSeconds;
  }
  return summary;
}

}  // namespace cohort
