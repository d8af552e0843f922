// `--strategy mirrored | central | hogwild --replicas R`: the CLI's adapter over the library's
// in-process replica handles (include/cohort/replicas.h, src/schemes/replicas.cpp). The process's
// batch (--batch) is split over its R replica threads.
#pragma once

#include <cohort/communicator.h>
#include <cohort/replicas.h>

#include "strategy/strategy.h"

#include <cstdint>
#include <memory>

namespace cohort {

class ReplicaStrategy final : public Strategy {
 public:
  // scheme: mirrored, central or hogwild. `comm`: mirrored across processes, else null.
  ReplicaStrategy(Scheme scheme, std::shared_ptr<Communicator> comm, ReplicaOptions options);
  ~ReplicaStrategy() override;

  Scheme scheme() const override { return scheme_; }
  // Mirrored and central: replica r on the GPU after the model's, r places on (replicas.h).
  bool trainsOnDevices() const override { return scheme_ != Scheme::kHogwild; }
  std::shared_ptr<Communicator> communicator() const override { return comm_; }
  ReplicaInfo replica() const override;
  void resumeAt(int64_t step) override { resumedAt_ = step; }
  void attach(torch::nn::Sequential model, torch::optim::Optimizer& optimizer) override;
  StepStats step(const Batch& batch, const LossFn& loss) override;
  // Mirrored: averages the replicas' buffers (and the processes'). A collective.
  void synchronize() override;
  MetricFields report() override;
  // Hogwild: the optimizers of replicas 1..R-1 ("hogwild_optimizer_R"), each its own (momentum,
  // Adam's moments), beside the Trainer's checkpoint of replica 0's; loaded over the copies of
  // replica 0's that attach() made. A checkpoint without them (an earlier cohort's, or of fewer
  // replicas) leaves those replicas with replica 0's state, and says so.
  void saveState(torch::serialize::OutputArchive& archive) override;
  void loadState(torch::serialize::InputArchive& archive) override;

  ReplicaGroup* group() const { return group_.get(); }

 private:
  Scheme scheme_;
  std::shared_ptr<Communicator> comm_;
  ReplicaOptions options_;
  std::unique_ptr<ReplicaGroup> group_;
  int64_t resumedAt_ = 0;
};

}  // namespace cohort
