// Optimizers for libtorch's C++ frontend that its own lack.
//
//   cohort::ForeachSGD optimizer(net->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
//
// ForeachSGD is torch::optim::SGD (the same options, the same momentum buffers, the same
// checkpoints: save one, load it into the other) whose step() updates all of a group's parameters
// at once with ATen's _foreach_ operators, as PyTorch's Python SGD does by default on a GPU: on
// CUDA a handful of multi-tensor kernels a step, where torch::optim::SGD launches three or four
// kernels per parameter, one after the other. On a GPU a small model's step is short enough for
// those launches to be what limits it. On the CPU the _foreach_ operators run per tensor: the same
// work and the same result, bit for bit.
//
// A step whose gradients include a sparse one, or that is given a closure, is torch::optim::SGD's
// own.
#pragma once

#include <cohort/export.h>

#include <torch/optim/sgd.h>

namespace cohort {

class COHORT_API ForeachSGD : public torch::optim::SGD {
 public:
  using torch::optim::SGD::SGD;

  torch::Tensor step(LossClosure closure = nullptr) override;
};

}  // namespace cohort
