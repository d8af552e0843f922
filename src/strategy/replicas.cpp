#include "strategy/replicas.h"

#include <cohort/error.h>

#include "schemes/model_sync.h"

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>

namespace cohort {

ReplicaStrategy::ReplicaStrategy(Scheme scheme, std::shared_ptr<Communicator> comm, ReplicaOptions options)
    : scheme_(scheme), comm_(std::move(comm)), options_(options) {
  COHORT_CHECK(options_.replicas >= 1, InvalidArgument, "--replicas must be at least 1, got ", options_.replicas);
}

ReplicaStrategy::~ReplicaStrategy() = default;

ReplicaInfo ReplicaStrategy::replica() const {
  return comm_ ? ReplicaInfo{comm_->rank(), comm_->worldSize()} : ReplicaInfo{};
}

void ReplicaStrategy::attach(torch::nn::Sequential model, torch::optim::Optimizer& optimizer) {
  std::shared_ptr<torch::nn::Module> module = model.ptr();
  if (scheme_ == Scheme::kMirrored) {
    group_ = comm_ ? std::make_unique<Mirrored>(Job::fromCommunicator(comm_), module, optimizer, options_)
                   : std::make_unique<Mirrored>(module, optimizer, options_);
  } else if (scheme_ == Scheme::kCentral) {
    group_ = std::make_unique<CentralStorage>(module, optimizer, options_);
  } else {
    group_ = std::make_unique<Hogwild>(module, optimizer, options_);
  }
}

// Mirrored's copies of the optimizer are replica 0's bit for bit and CentralStorage has one;
// Hogwild's each follow their own gradients.
void ReplicaStrategy::saveState(torch::serialize::OutputArchive& archive) {
  if (scheme_ != Scheme::kHogwild || !group_) return;
  for (int r = 1; r < group_->replicas(); ++r) {
    std::string bytes = optimizerBytes(group_->optimizer(r));
    archive.write("hogwild_optimizer_" + std::to_string(r),
                  torch::from_blob(bytes.data(), {int64_t(bytes.size())}, torch::kUInt8).clone());
  }
}

void ReplicaStrategy::loadState(torch::serialize::InputArchive& archive) {
  if (scheme_ != Scheme::kHogwild || !group_) return;
  int missing = 0;
  for (int r = 1; r < group_->replicas(); ++r) {
    torch::Tensor packed;
    if (!archive.try_read("hogwild_optimizer_" + std::to_string(r), packed)) {
      ++missing;
      continue;
    }
    const torch::Tensor bytes = packed.to(torch::kCPU).contiguous();
    torch::serialize::InputArchive saved;
    saved.load_from(reinterpret_cast<const char*>(bytes.data_ptr<uint8_t>()), size_t(bytes.numel()));
    loadOptimizerKeepingOptions(group_->optimizer(r), saved);  // the run's --lr and --momentum stay
  }
  if (missing > 0 && !group_->optimizer(0).state().empty()) {
    std::fprintf(stderr,
                 "cohort: warning: hogwild resumed at step %lld: %d of replicas 1-%d start from replica 0's optimizer "
                 "state (the checkpoint holds no optimizer of theirs: written by an earlier cohort, or with fewer "
                 "--replicas)\n",
                 (long long)resumedAt_, missing, group_->replicas() - 1);
  }
}

StepStats ReplicaStrategy::step(const Batch& batch, const LossFn& loss) {
  COHORT_CHECK(group_ != nullptr, Error, "ReplicaStrategy::step before attach");
  const auto start = std::chrono::steady_clock::now();
  const ReplicaStats before = group_->stats();
  const double value = group_->step(
      batch.inputs, batch.targets,
      [&loss, autocast = autocast()](int, torch::nn::Module& m, const torch::Tensor& x, const torch::Tensor& y) {
        // On the replica's thread: autocast's state is per thread.
        return forwardLoss(*m.as<torch::nn::SequentialImpl>(), x, y, loss, autocast);
      });
  const ReplicaStats after = group_->stats();
  StepStats stats;
  stats.loss = value;
  stats.samples = batch.size() * (comm_ ? comm_->worldSize() : 1);
  stats.bytesSent = after.bytesSent - before.bytesSent;
  stats.bytesReceived = after.bytesReceived - before.bytesReceived;
  stats.commWaitSeconds = after.commWaitSeconds - before.commWaitSeconds;
  stats.computeSeconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() - stats.commWaitSeconds;
  // Where a replica's time went in this step (means over the replicas).
  stats.extra.emplace_back("replica_handoff_s", after.times.handOff - before.times.handOff);
  stats.extra.emplace_back("replica_forward_s", after.times.forward - before.times.forward);
  stats.extra.emplace_back("replica_backward_s", after.times.backward - before.times.backward);
  stats.extra.emplace_back("replica_copy_s", after.times.copy - before.times.copy);
  stats.extra.emplace_back("replica_sum_s", after.times.sum - before.times.sum);
  stats.extra.emplace_back("replica_optimizer_s", after.times.optimizer - before.times.optimizer);
  stats.extra.emplace_back("replica_wait_s", after.waitSeconds - before.waitSeconds);
  if (options_.balance && !after.lastShards.empty()) {
    // The split of this step's batch: the largest shard's examples.
    stats.extra.emplace_back("replica_largest_shard",
                             *std::max_element(after.lastShards.begin(), after.lastShards.end()));
  }
  if (scheme_ == Scheme::kHogwild) {
    const int64_t updates = after.updates - before.updates;
    stats.extra.emplace_back("staleness", updates > 0 ? (after.stalenessSum - before.stalenessSum) / double(updates) : 0.0);
    stats.extra.emplace_back("conflicts", after.conflicts - before.conflicts);
  }
  return stats;
}

void ReplicaStrategy::synchronize() {
  if (group_) group_->synchronizeBuffers();
}

MetricFields ReplicaStrategy::report() {
  if (!group_) return {};
  const ReplicaStats s = group_->stats();
  MetricFields fields{{"replicas", int64_t(group_->replicas())}, {"replica_wait_s", s.waitSeconds}};
  if (scheme_ == Scheme::kHogwild) {
    fields.emplace_back("updates", s.updates);
    fields.emplace_back("staleness_mean", s.updates > 0 ? s.stalenessSum / double(s.updates) : 0.0);
    fields.emplace_back("staleness_max", s.stalenessMax);
    fields.emplace_back("conflict_fraction", s.updates > 0 ? double(s.conflicts) / double(s.updates) : 0.0);
  } else {
    fields.emplace_back("bytes_reduced_in_memory", s.bytesReduced);
    fields.emplace_back("buckets", s.buckets);
  }
  return fields;
}

}  // namespace cohort
