// `--strategy mirrored | central | hogwild --replicas R`: the CLI's adapter over the library's
// in-process replica handles (include/cohort/replicas.h, src/schemes/replicas.cpp). The process's
// batch (--batch) is split over its R replica threads.
#pragma once

#include <cohort/communicator.h>
#include <cohort/replicas.h>

#include "strategy/strategy.h"

#include <memory>

namespace cohort {

class ReplicaStrategy final : public Strategy {
 public:
  // name: mirrored, central or hogwild. `comm`: mirrored across processes, else null.
  ReplicaStrategy(std::string name, std::shared_ptr<Communicator> comm, ReplicaOptions options);
  ~ReplicaStrategy() override;

  std::string name() const override { return name_; }
  std::shared_ptr<Communicator> communicator() const override { return comm_; }
  ReplicaInfo replica() const override;
  void attach(torch::nn::Sequential model, torch::optim::Optimizer& optimizer) override;
  StepStats step(const Batch& batch, const LossFn& loss) override;
  // Mirrored: averages the replicas' buffers (and the processes'). A collective.
  void synchronize() override;
  MetricFields report() override;

 private:
  std::string name_;
  std::shared_ptr<Communicator> comm_;
  ReplicaOptions options_;
  std::unique_ptr<ReplicaGroup> group_;
};

}  // namespace cohort
