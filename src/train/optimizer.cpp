#include "train/optimizer.h"

#include "schemes/model_sync.h"
#include "train/lazy_optimizer.h"
#include <cohort/error.h>
#include <cohort/optim.h>

#include <torch/torch.h>

#include <array>
#include <utility>

namespace cohort {

namespace {

constexpr std::array<std::pair<OptimizerKind, const char*>, 4> kNames{{
    {OptimizerKind::kSgd, "sgd"},
    {OptimizerKind::kMomentum, "momentum"},
    {OptimizerKind::kAdam, "adam"},
    {OptimizerKind::kAdagrad, "adagrad"},
}};

}  // namespace

const char* optimizerName(OptimizerKind kind) {
  for (const auto& [k, name] : kNames) {
    if (k == kind) return name;
  }
  return "?";
}

std::optional<OptimizerKind> parseOptimizer(std::string_view name) {
  for (const auto& [k, n] : kNames) {
    if (name == n) return k;
  }
  return std::nullopt;
}

std::vector<OptimizerKind> allOptimizers() {
  std::vector<OptimizerKind> out;
  for (const auto& [k, name] : kNames) out.push_back(k);
  return out;
}

std::unique_ptr<torch::optim::Optimizer> makeOptimizer(OptimizerKind kind, double lr, double momentum,
                                                       torch::nn::Module& model) {
  const std::vector<torch::Tensor> params = model.parameters();
  // A sparse embedding table: updates by rows, lazily (train/lazy_optimizer.h).
  if (hasRowSparseTable(model)) return std::make_unique<LazyOptimizer>(params, kind, lr, momentum);
  switch (kind) {
    // torch::optim::SGD's update and state, its step in multi-tensor kernels on a GPU.
    case OptimizerKind::kSgd: return std::make_unique<ForeachSGD>(params, torch::optim::SGDOptions(lr));
    case OptimizerKind::kMomentum:
      return std::make_unique<ForeachSGD>(params, torch::optim::SGDOptions(lr).momentum(momentum));
    case OptimizerKind::kAdam: return std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(lr));
    case OptimizerKind::kAdagrad:
      return std::make_unique<torch::optim::Adagrad>(params, torch::optim::AdagradOptions(lr));
  }
  throw InvalidArgument("unknown optimizer: expected sgd, momentum, adam or adagrad");
}

PsOptimizer psOptimizer(OptimizerKind kind) {
  switch (kind) {
    case OptimizerKind::kSgd: return PsOptimizer::kSgd;
    case OptimizerKind::kMomentum: return PsOptimizer::kMomentum;
    case OptimizerKind::kAdam: return PsOptimizer::kAdam;
    case OptimizerKind::kAdagrad: return PsOptimizer::kAdagrad;
  }
  return PsOptimizer::kSgd;  // unreachable: every kind is listed
}

}  // namespace cohort
