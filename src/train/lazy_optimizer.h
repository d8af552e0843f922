// The Trainer's optimizer for models with row-sparse gradients (a sparse embedding table):
// sgd, momentum, adam and adagrad with the parameter server's arithmetic (ps/optimizer.h), lazy
// on row-sparse gradients: only the rows a step touched are updated, and only their state. Dense
// gradients are applied whole. torch::optim's SGD keeps a sparse momentum buffer that grows
// without bound and its Adam refuses sparse gradients, hence this one.
#pragma once

#include "train/optimizer.h"

#include <torch/optim/optimizer.h>

#include <memory>
#include <string>
#include <vector>

namespace cohort {

namespace ps {
class ServerOptimizer;
}

class LazyOptimizer final : public torch::optim::Optimizer {
 public:
  LazyOptimizer(std::vector<torch::Tensor> params, OptimizerKind kind, double lr, double momentum);
  ~LazyOptimizer() override;

  torch::Tensor step(LossClosure closure = nullptr) override;
  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;

 private:
  std::vector<std::unique_ptr<ps::ServerOptimizer>> perParameter_;
};

}  // namespace cohort
