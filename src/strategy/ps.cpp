#include "strategy/ps.h"

#include <cohort/error.h>

#include "base/clock.h"
#include "strategy/local.h"

#include <cohort/models.h>

#include <torch/torch.h>

namespace cohort {

namespace {

// `--strategy ps`: the CLI's adapter over the handle.
class PsStrategy final : public Strategy {
 public:
  PsStrategy(Job job, ParameterServerOptions options) : job_(std::move(job)), options_(std::move(options)) {}

  Scheme scheme() const override { return Scheme::kPs; }
  // The workers' models on a device, the shards CPU processes (ParameterServerClient).
  bool trainsOnDevices() const override { return true; }
  ReplicaInfo replica() const override { return {job_.rank(), job_.worldSize()}; }

  void attach(torch::nn::Sequential model, torch::optim::Optimizer& optimizer) override {
    model_ = model;
    optimizer_ = &optimizer;
    client_ = std::make_unique<ParameterServerClient>(job_, *model, &optimizer, options_);
    sparse_ = !rowsRead(model_, torch::empty({0, 0}, torch::kInt64)).empty();
  }

  StepStats step(const Batch& batch, const LossFn& loss) override {
    const auto start = Clock::now();
    torch::Tensor out;
    if (options_.push == PsPush::kUpdates) {
      out = forwardBackwardStep(model_, *optimizer_, batch, loss, autocast());
    } else {
      clearGradients(*model_);
      out = forwardLoss(*model_, batch.inputs, batch.targets, loss, autocast());
      out.backward();
    }
    StepStats stats;
    stats.loss = out.item<double>();
    stats.computeSeconds = secondsSince(start);
    const ParameterServerStep pushed = client_->step(batch.inputs.size(0));
    stats.samples = pushed.samples;
    stats.bytesSent = pushed.bytesSent;
    stats.bytesReceived = pushed.bytesReceived;
    stats.commWaitSeconds = pushed.commWaitSeconds;
    stats.extra = {{"staleness", pushed.staleness},
                   {"applied", pushed.applied},
                   {"server_wait_s", pushed.serverWaitSeconds}};
    if (!pushed.applied) stats.extra.emplace_back("dropped", pushed.dropped);
    stats.stopJob = pushed.stopJob;
    return stats;
  }

  // A sparse model's next batch: its rows come back with this step's push. No next batch: the
  // push asks for no rows (nothing follows, or synchronize() brings the whole model).
  bool readsAhead() const override { return true; }
  void upcoming(const Batch& next) override {
    const torch::Tensor ids = next.inputs.defined() ? next.inputs : torch::empty({0, 0}, torch::kInt64);
    for (const auto& [table, rows] : rowsRead(model_, ids)) client_->prefetchRows(table, rows);
  }

  // The whole model, for the chief's evaluation. A sparse model's other workers evaluate nothing
  // and hold the rows their next step reads (upcoming() named them): a whole table for each of
  // them at every evaluation would be paid for nothing.
  void synchronize() override {
    if (joinsEvaluation() || !sparse_) client_->synchronize();
  }
  std::optional<int64_t> resumeStep() const override { return client_->resumeStep(); }
  // The shards checkpoint the parameters and every worker's clock.
  CheckpointPlan checkpointPlan() const override {
    CheckpointPlan plan;
    plan.keptByScheme = true;
    return plan;
  }
  void finish() override { client_->finish(); }
  void requestStop() override { client_->requestStop(); }
  MetricFields report() override { return client_->report(); }
  std::optional<std::string> finalCheckpointError() const override { return client_->finalCheckpointError(); }

 private:
  Job job_;
  ParameterServerOptions options_;
  torch::nn::Sequential model_{nullptr};
  torch::optim::Optimizer* optimizer_ = nullptr;
  std::unique_ptr<ParameterServerClient> client_;
  bool sparse_ = false;  // the model has a sparse embedding table (rows read ahead)
};

}  // namespace

std::unique_ptr<Strategy> makePsStrategy(const Job& job, ParameterServerOptions options) {
  return std::make_unique<PsStrategy>(job, std::move(options));
}

}  // namespace cohort
