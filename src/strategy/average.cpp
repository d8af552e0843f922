#include "strategy/average.h"

#include <cohort/error.h>

#include "strategy/allreduce.h"
#include "strategy/local.h"

#include <torch/torch.h>

#include <chrono>

namespace cohort {

namespace {

using Clock = std::chrono::steady_clock;

double secondsSince(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

}  // namespace

std::vector<torch::Tensor> optimizerStateTensors(torch::optim::Optimizer& optimizer) {
  std::vector<torch::Tensor> out;
  auto& state = optimizer.state();
  for (auto& group : optimizer.param_groups()) {
    for (auto& p : group.params()) {
      auto it = state.find(c10::guts::to_string(p.unsafeGetTensorImpl()));
      if (it == state.end()) {
        // No state yet (the parameter never had a gradient here): a zero placeholder of the
        // kind the optimizer keeps, so that every rank packs the same tensors.
        if (auto* sgd = dynamic_cast<torch::optim::SGD*>(&optimizer)) {
          const auto& o = static_cast<const torch::optim::SGDOptions&>(sgd->defaults());
          if (o.momentum() != 0) out.push_back(torch::zeros_like(p));
        } else if (dynamic_cast<torch::optim::Adam*>(&optimizer) != nullptr) {
          out.push_back(torch::zeros_like(p));
          out.push_back(torch::zeros_like(p));
        }
        continue;
      }
      if (auto* sgd = dynamic_cast<torch::optim::SGDParamState*>(it->second.get())) {
        out.push_back(sgd->momentum_buffer());
      } else if (auto* adam = dynamic_cast<torch::optim::AdamParamState*>(it->second.get())) {
        out.push_back(adam->exp_avg());
        out.push_back(adam->exp_avg_sq());
      }
    }
  }
  return out;
}

AverageStrategy::AverageStrategy(std::shared_ptr<Communicator> comm, AverageOptions options)
    : comm_(std::move(comm)), options_(options) {
  COHORT_CHECK(comm_ != nullptr, InvalidArgument, "--strategy average needs a cluster");
  COHORT_CHECK(options_.period >= 1, InvalidArgument, "--period must be at least 1, got ", options_.period);
}

ReplicaInfo AverageStrategy::replica() const { return {comm_->rank(), comm_->worldSize()}; }

void AverageStrategy::attach(torch::nn::Sequential model, torch::optim::Optimizer& optimizer) {
  model_ = std::move(model);
  optimizer_ = &optimizer;
  broadcastModel(*comm_, *model_);
  if (options_.codec.kind != compress::CodecKind::None) {
    torch::NoGradGuard noGrad;
    std::vector<torch::Tensor> flat;
    for (auto& p : model_->parameters()) flat.push_back(p.detach().reshape({-1}));
    anchor_ = torch::cat(flat);
    delta_ = torch::empty_like(anchor_);
    compressed_ = std::make_unique<CompressedSum>(comm_, options_.codec, std::vector<int64_t>{anchor_.numel()});
  }
}

void AverageStrategy::averageChanges() {
  torch::NoGradGuard noGrad;
  auto params = model_->parameters();
  int64_t offset = 0;
  for (auto& p : params) {
    delta_.narrow(0, offset, p.numel()).copy_(p.detach().reshape({-1}));
    offset += p.numel();
  }
  delta_.sub_(anchor_).mul_(1.0 / comm_->worldSize());
  const CommCounters before = comm_->counters();
  const int64_t sent = compressed_->bytesSent(), received = compressed_->bytesReceived();
  CommWork work = compressed_->start(0, delta_);
  if (work.valid()) work.wait();
  compressed_->finish(0, delta_);
  // The codec's count (its messages' real sizes) replaces the communicator's for this exchange.
  const CommCounters after = comm_->counters();
  bytesSentAdjust_ += (compressed_->bytesSent() - sent) - (after.bytesSent - before.bytesSent);
  bytesReceivedAdjust_ += (compressed_->bytesReceived() - received) - (after.bytesReceived - before.bytesReceived);
  anchor_.add_(delta_);
  offset = 0;
  for (auto& p : params) {
    p.detach().copy_(anchor_.narrow(0, offset, p.numel()).view_as(p));
    offset += p.numel();
  }
}

double AverageStrategy::average() {
  const auto start = Clock::now();
  std::vector<torch::Tensor> tensors;
  if (compressed_ && steps_ > options_.codecWarmupSteps) {
    averageChanges();
  } else {
    for (auto& p : model_->parameters()) tensors.push_back(p);
    if (compressed_) {  // the warm-up: average uncompressed, and start the changes from here
      averageInPlace(*comm_, tensors);
      tensors.clear();
      torch::NoGradGuard noGrad;
      int64_t offset = 0;
      for (auto& p : model_->parameters()) {
        anchor_.narrow(0, offset, p.numel()).copy_(p.detach().reshape({-1}));
        offset += p.numel();
      }
    }
  }
  for (auto& b : model_->buffers()) tensors.push_back(b);
  if (options_.averageOptimizerState) {
    for (auto& t : optimizerStateTensors(*optimizer_)) tensors.push_back(t);
  }
  averageInPlace(*comm_, tensors);
  sinceAverage_ = 0;
  return secondsSince(start);
}

StepStats AverageStrategy::step(const Batch& batch, const LossFn& loss) {
  COHORT_CHECK(optimizer_ != nullptr, Error, "AverageStrategy::step before attach");
  const auto start = Clock::now();
  bytesSentAdjust_ = bytesReceivedAdjust_ = 0;
  const CommCounters before = comm_->counters();
  auto value = forwardBackwardStep(model_, *optimizer_, batch, loss);
  ++steps_;
  StepStats stats;
  stats.loss = value.item<double>();
  if (++sinceAverage_ >= options_.period) stats.commWaitSeconds = average();
  const CommCounters after = comm_->counters();
  stats.samples = batch.size() * comm_->worldSize();
  stats.bytesSent = after.bytesSent - before.bytesSent + bytesSentAdjust_;
  stats.bytesReceived = after.bytesReceived - before.bytesReceived + bytesReceivedAdjust_;
  bytesSentAdjust_ = bytesReceivedAdjust_ = 0;
  stats.computeSeconds = secondsSince(start) - stats.commWaitSeconds;
  return stats;
}

void AverageStrategy::synchronize() {
  if (sinceAverage_ > 0) average();
}

}  // namespace cohort
