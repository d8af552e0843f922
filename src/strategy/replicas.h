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
  // Hogwild resumed: says that replicas 1..R-1 start from replica 0's optimizer state (a
  // checkpoint holds the caller's optimizer only; theirs are copies of it made at attach).
  void resumeAt(int64_t step) override { resumedAt_ = step; }
  void attach(torch::nn::Sequential model, torch::optim::Optimizer& optimizer) override;
  StepStats step(const Batch& batch, const LossFn& loss) override;
  // Mirrored: averages the replicas' buffers (and the processes'). A collective.
  void synchronize() override;
  MetricFields report() override;

 private:
  Scheme scheme_;
  std::shared_ptr<Communicator> comm_;
  ReplicaOptions options_;
  std::unique_ptr<ReplicaGroup> group_;
  int64_t resumedAt_ = 0;
};

}  // namespace cohort
