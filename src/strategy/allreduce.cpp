#include "strategy/allreduce.h"

#include <cohort/error.h>

#include "strategy/local.h"

#include <torch/torch.h>

#include <chrono>

namespace cohort {

namespace {

using Clock = std::chrono::steady_clock;

double secondsSince(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

}  // namespace

void exchangePacked(const std::vector<torch::Tensor>& tensors,
                    const std::function<void(torch::Tensor& packed)>& exchange) {
  torch::NoGradGuard noGrad;
  std::map<c10::ScalarType, std::vector<torch::Tensor>> byType;
  for (const auto& t : tensors) byType[t.scalar_type()].push_back(t);
  for (auto& [type, group] : byType) {
    std::vector<torch::Tensor> flat;
    for (auto& t : group) flat.push_back(t.reshape({-1}));
    auto packed = torch::cat(flat);
    exchange(packed);
    int64_t offset = 0;
    for (auto& t : group) {
      t.copy_(packed.narrow(0, offset, t.numel()).view_as(t));
      offset += t.numel();
    }
  }
}

void averageInPlace(Communicator& comm, const std::vector<torch::Tensor>& tensors) {
  std::vector<torch::Tensor> floating;
  for (const auto& t : tensors) {
    if (t.defined() && t.is_floating_point()) floating.push_back(t);
  }
  exchangePacked(floating, [&](torch::Tensor& packed) {
    comm.allreduce(packed);
    packed.div_(comm.worldSize());
  });
}

void broadcastModel(Communicator& comm, torch::nn::Module& model) {
  std::vector<torch::Tensor> tensors;
  for (auto& p : model.parameters()) tensors.push_back(p);
  for (auto& b : model.buffers()) tensors.push_back(b);  // may be int64, e.g. BatchNorm's count
  exchangePacked(tensors, [&](torch::Tensor& packed) { comm.broadcast(packed, 0); });
}

AllreduceStrategy::AllreduceStrategy(std::shared_ptr<Communicator> comm, AllreduceOptions options)
    : comm_(std::move(comm)), options_(options) {
  COHORT_CHECK(comm_ != nullptr, InvalidArgument, "--strategy allreduce needs a cluster");
  COHORT_CHECK(options_.bucketMb > 0, InvalidArgument, "--bucket-mb must be positive, got ", options_.bucketMb);
  scale_ = 1.0 / comm_->worldSize();
}

AllreduceStrategy::~AllreduceStrategy() = default;

ReplicaInfo AllreduceStrategy::replica() const { return {comm_->rank(), comm_->worldSize()}; }

void AllreduceStrategy::attach(torch::nn::Sequential model, torch::optim::Optimizer& optimizer) {
  model_ = std::move(model);
  optimizer_ = &optimizer;
  broadcastModel(*comm_, *model_);

  for (auto& p : model_->parameters()) {
    if (p.requires_grad()) params_.push_back(p);
  }
  // Buckets in reverse parameter order, the first capped at firstBucketMb.
  slotOf_.resize(params_.size());
  std::vector<std::vector<size_t>> groups(1);
  int64_t bytes = 0;
  for (size_t k = params_.size(); k-- > 0;) {
    const int64_t size = params_[k].numel() * int64_t(params_[k].element_size());
    const double capMb = groups.size() == 1 ? options_.firstBucketMb : options_.bucketMb;
    if (!groups.back().empty() && double(bytes + size) > capMb * 1024 * 1024) {
      groups.emplace_back();
      bytes = 0;
    }
    groups.back().push_back(k);
    bytes += size;
  }
  for (auto& group : groups) {
    Bucket bucket;
    int64_t numel = 0;
    for (size_t k : group) numel += params_[k].numel();
    bucket.flat = torch::zeros({numel}, params_[group.front()].options().requires_grad(false));
    int64_t offset = 0;
    for (size_t k : group) {
      slotOf_[k] = {buckets_.size(), bucket.params.size()};
      bucket.params.push_back(k);
      bucket.views.push_back(bucket.flat.narrow(0, offset, params_[k].numel()).view_as(params_[k]));
      offset += params_[k].numel();
    }
    bucket.filled.assign(group.size(), false);
    buckets_.push_back(std::move(bucket));
  }
  std::vector<int64_t> sizes;
  for (auto& bucket : buckets_) sizes.push_back(bucket.flat.numel());
  compressed_ = std::make_unique<CompressedSum>(comm_, options_.codec, sizes);
  plain_ = std::make_unique<CompressedSum>(comm_, compress::CodecSpec{}, sizes);
  for (size_t k = 0; k < params_.size(); ++k) {
    params_[k].register_hook([this, k](torch::Tensor grad) { onGradient(k, grad); });
  }
}

void AllreduceStrategy::synchronize() {
  if (model_) averageInPlace(*comm_, model_->buffers());
}

void AllreduceStrategy::onGradient(size_t param, const torch::Tensor& grad) {
  if (!inStep_) return;
  auto [b, i] = slotOf_[param];
  Bucket& bucket = buckets_[b];
  torch::NoGradGuard noGrad;
  torch::mul_out(bucket.views[i], grad, scale_);
  if (!bucket.filled[i]) {
    bucket.filled[i] = true;
    --bucket.pending;
  }
  if (options_.overlap) launchReady();
}

void AllreduceStrategy::launchReady() {
  CompressedSum& sum = exchange();
  // bf16 and the sparse codecs exchange synchronously: not from inside backward.
  const bool async = sum.spec().kind == compress::CodecKind::None || sum.spec().kind == compress::CodecKind::Fp16;
  if (inStep_ && !async) return;
  while (nextToLaunch_ < buckets_.size() && buckets_[nextToLaunch_].pending == 0) {
    Bucket& bucket = buckets_[nextToLaunch_];
    bucket.work = sum.start(nextToLaunch_, bucket.flat);
    bucket.launched = true;
    ++nextToLaunch_;
  }
}

StepStats AllreduceStrategy::step(const Batch& batch, const LossFn& loss) {
  COHORT_CHECK(optimizer_ != nullptr, Error, "AllreduceStrategy::step before attach");
  const auto start = Clock::now();
  CompressedSum& sum = exchange();
  const int64_t sentBefore = sum.bytesSent();
  const int64_t receivedBefore = sum.bytesReceived();
  for (auto& bucket : buckets_) {
    bucket.pending = bucket.params.size();
    bucket.filled.assign(bucket.params.size(), false);
    bucket.launched = false;
  }
  nextToLaunch_ = 0;
  clearGradients(*model_);

  inStep_ = true;
  torch::Tensor value;
  try {
    value = loss(model_->forward(batch.inputs), batch.targets);
    value.backward();
  } catch (...) {
    inStep_ = false;
    throw;
  }
  inStep_ = false;
  // Parameters that got no gradient this step contribute zeros.
  for (auto& bucket : buckets_) {
    for (size_t i = 0; i < bucket.params.size(); ++i) {
      if (!bucket.filled[i]) {
        bucket.views[i].zero_();
        bucket.filled[i] = true;
      }
    }
    bucket.pending = 0;
  }
  const auto waitStart = Clock::now();
  launchReady();  // bf16 and sparse codecs: the whole exchange happens here
  for (auto& bucket : buckets_) {
    if (bucket.work.valid()) bucket.work.wait();
  }
  for (size_t b = 0; b < buckets_.size(); ++b) sum.finish(b, buckets_[b].flat);
  const double waited = secondsSince(waitStart);

  for (auto& bucket : buckets_) {
    for (size_t i = 0; i < bucket.params.size(); ++i) params_[bucket.params[i]].mutable_grad() = bucket.views[i];
  }
  optimizer_->step();

  ++steps_;
  StepStats stats;
  stats.loss = value.item<double>();
  stats.samples = batch.size() * comm_->worldSize();
  stats.bytesSent = sum.bytesSent() - sentBefore;
  stats.bytesReceived = sum.bytesReceived() - receivedBefore;
  stats.commWaitSeconds = waited;
  stats.computeSeconds = secondsSince(start) - waited;
  return stats;
}

}  // namespace cohort
