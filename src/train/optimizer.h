// The Trainer's optimizers: the kinds --optimizer names, parsed once where a name comes in (the
// command line's --optimizer, which a --config file and compare and sweep files pass on as an
// argument), and the optimizer each kind makes for a model. Inside, the code compares
// OptimizerKinds, never names.
#pragma once

#include <cohort/parameter_server.h>

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <memory>
#include <optional>
#include <string_view>
#include <vector>

namespace cohort {

enum class OptimizerKind { kSgd, kMomentum, kAdam, kAdagrad };

// The name --optimizer gives it: "sgd", "momentum", "adam" or "adagrad". Checkpoints' fingerprints
// and the parameter server's Init carry this name.
const char* optimizerName(OptimizerKind kind);

// The kind a name means; nullopt for any other text (the caller names what it read and where).
std::optional<OptimizerKind> parseOptimizer(std::string_view name);

// Every kind, in declaration order.
std::vector<OptimizerKind> allOptimizers();

// The same optimizer run by the parameter-server shards (ParameterServerOptions::optimizer).
PsOptimizer psOptimizer(OptimizerKind kind);

// The optimizer of `model`'s parameters: ForeachSGD (torch::optim::SGD's update in multi-tensor
// kernels; with `momentum` for kMomentum), torch::optim's Adam or Adagrad at `lr`; for a model with a sparse embedding
// table, the lazy optimizer of the same kind (train/lazy_optimizer.h), which updates only the rows a step touched.
std::unique_ptr<torch::optim::Optimizer> makeOptimizer(OptimizerKind kind, double lr, double momentum,
                                                       torch::nn::Module& model);

}  // namespace cohort
