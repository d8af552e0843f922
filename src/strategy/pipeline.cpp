#include "strategy/pipeline.h"

#include <cohort/error.h>

#include "schemes/pipeline_plan.h"

#include <torch/torch.h>

namespace cohort {

PipelineStrategy::PipelineStrategy(std::shared_ptr<Communicator> comm, Options options, std::string checkpointDir,
                                   bool resume)
    : comm_(std::move(comm)), options_(std::move(options)), checkpointDir_(std::move(checkpointDir)), resume_(resume) {
  const int S = options_.stages;
  const int R = options_.replicas;
  COHORT_CHECK(S >= 1, InvalidArgument, "--stages must be positive, got ", S);
  COHORT_CHECK(R >= 1, InvalidArgument, "--replicas must be positive, got ", R);
  COHORT_CHECK(options_.microBatches >= 1 || options_.microBatches == kAutoMicroBatches, InvalidArgument,
               "--micro-batches must be positive or auto, got ", options_.microBatches);
  // One process has no communicator (Job::communicator()): no stage to send to.
  COHORT_CHECK(comm_ != nullptr || S * R > 1, InvalidArgument, "--strategy pipeline --stages ", S, " --replicas ", R,
               " is one process, which has no other stage to pipeline with: use --strategy local, or launch "
               "stages x replicas processes (cohort launch -n 2 ... --stages 2)");
  COHORT_CHECK(comm_ != nullptr && comm_->worldSize() == S * R, InvalidArgument, "--strategy pipeline --stages ", S,
               " --replicas ", R, " needs ", S * R, " processes (cohort launch -n ", S * R, "), but this job has ",
               comm_ ? comm_->worldSize() : 1);
  COHORT_CHECK(!(options_.partition.splitsALayer() && options_.microBatches == kAutoMicroBatches), InvalidArgument,
               "--partition ", options_.partition.text(), " splits a layer, which --micro-batches auto does not model: give a count of "
               "micro-batches, or a cut between layers (auto or L1,L2,...)");
  stage_ = comm_->rank() % S;
  replica_ = comm_->rank() / S;
  comm_->setRankNames([S, R](int rank) {
    std::string name = "rank " + std::to_string(rank) + " (stage " + std::to_string(rank % S);
    if (R > 1) name += " of replica " + std::to_string(rank / S);
    return name + ")";
  });
}

PipelineStrategy::~PipelineStrategy() = default;

torch::nn::Sequential PipelineStrategy::localModel(torch::nn::Sequential model, const Batch& sample) {
  pipeline_ = std::make_unique<Pipeline>(Job::fromCommunicator(comm_), model, sample.inputs,
                                         PipelineOptions{.stages = options_.stages,
                                                         .replicas = options_.replicas,
                                                         .microBatches = options_.microBatches,
                                                         .schedule = options_.schedule,
                                                         .partition = options_.partition,
                                                         .checkpointDir = checkpointDir_,
                                                         .resume = resume_,
                                                         .autocast = autocast()});
  options_.microBatches = pipeline_->microBatches();
  return pipeline_->module();
}

CheckpointPlan PipelineStrategy::checkpointPlan() const {
  return {.writes = replica_ == 0,
          .subdir = "stage-" + std::to_string(stage_),
          .group = pipeline_->stageJob().communicator()};
}

std::string PipelineStrategy::layout() const {
  return "stage=" + std::to_string(stage_) + "/" + std::to_string(options_.stages) +
         " cut=" + joinCut(pipeline_->cut(), pipeline_->splits());
}

void PipelineStrategy::attach(torch::nn::Sequential model, torch::optim::Optimizer& optimizer) {
  COHORT_CHECK(pipeline_ != nullptr, Error, "PipelineStrategy::attach before localModel");
  optimizer_ = &optimizer;
  // The stage's replicas start alike (after a resume too: each restored the same bytes).
  pipeline_->broadcastParameters();
}

StepStats PipelineStrategy::step(const Batch& batch, const LossFn& loss) {
  COHORT_CHECK(optimizer_ != nullptr, Error, "PipelineStrategy::step before attach");
  const PipelineStepStats s = pipeline_->step(batch.inputs, batch.targets, loss, *optimizer_);
  StepStats stats;
  stats.loss = s.loss;
  stats.samples = batch.size() * options_.replicas;
  stats.bytesSent = s.bytesSent;
  stats.bytesReceived = s.bytesReceived;
  stats.commWaitSeconds = s.waitSeconds;
  stats.computeSeconds = s.seconds - s.waitSeconds;
  // Where the step went: compute, blocked on a neighbour (idle), posting and finishing sends,
  // the optimizer; "other_s" is the rest (the loss message, averaging over replicas, the
  // schedule's bookkeeping).
  const double other = s.seconds - s.forwardSeconds - s.backwardSeconds - s.idleSeconds - s.sendSeconds -
                       s.sendWaitSeconds - s.optimizerSeconds;
  stats.extra = {{"idle_s", s.idleSeconds},
                 {"peak_activation_bytes", s.peakActivationBytes},
                 {"micro_batches", int64_t(s.microBatches)},
                 {"forward_s", s.forwardSeconds},
                 {"backward_s", s.backwardSeconds},
                 {"send_s", s.sendSeconds},
                 {"send_wait_s", s.sendWaitSeconds},
                 {"optimizer_s", s.optimizerSeconds},
                 {"other_s", other}};
  return stats;
}

torch::Tensor PipelineStrategy::infer(torch::nn::Sequential& model, const torch::Tensor& inputs) {
  return pipeline_->infer(inputs);
}

void PipelineStrategy::synchronize() { pipeline_->synchronizeBuffers(); }

void PipelineStrategy::finish() { summary_ = pipeline_->finish(); }

MetricFields PipelineStrategy::report() {
  const PipelineSummary& s = summary_;
  std::vector<int64_t> cut;
  for (int c : pipeline_->cut()) cut.push_back(c);
  std::vector<int64_t> splits;
  for (int c : pipeline_->splits()) splits.push_back(c);
  MetricFields fields{{"stages", int64_t(options_.stages)},
                      {"replicas", int64_t(options_.replicas)},
                      {"micro_batches", int64_t(options_.microBatches)},
                      {"micro_batches_auto", s.microBatchesAuto},
                      {"schedule", scheduleName(options_.schedule)},
                      {"cut", cut},
                      {"cut_split_channels", splits},
                      {"stage_peak_activation_bytes", s.stagePeakActivationBytes},
                      {"stage_idle_fraction", s.stageIdleFraction},
                      {"stage_compute_fraction", s.stageComputeFraction},
                      {"stage_send_fraction", s.stageSendFraction},
                      {"stage_optimizer_fraction", s.stageOptimizerFraction},
                      {"bubble_fraction", s.bubbleFraction},
                      {"bubble_fraction_theory", s.bubbleFractionTheory},
                      {"bubble_fraction_expected", s.bubbleFractionExpected}};
  if (s.microBatchesAuto) {
    fields.push_back({"micro_batch_fixed_cost_s", s.microBatchFixedSeconds});
    fields.push_back({"micro_batch_work_s", s.microBatchWorkSeconds});
    fields.push_back({"predicted_step_s", s.predictedStepSeconds});
  }
  return fields;
}

}  // namespace cohort
