#include "train/lazy_optimizer.h"

#include "ps/optimizer.h"
#include <cohort/error.h>
#include "schemes/model_sync.h"

#include <torch/torch.h>

#include <cstring>

namespace cohort {

namespace {

ps::UpdateRule updateRuleOf(OptimizerKind kind) {
  switch (kind) {
    case OptimizerKind::kSgd: return ps::UpdateRule::kSgd;
    case OptimizerKind::kMomentum: return ps::UpdateRule::kMomentum;
    case OptimizerKind::kAdam: return ps::UpdateRule::kAdam;
    case OptimizerKind::kAdagrad: return ps::UpdateRule::kAdagrad;
  }
  throw InvalidArgument("the lazy optimizer has no rule for optimizer kind " + std::to_string(int(kind)));
}

}  // namespace

LazyOptimizer::LazyOptimizer(std::vector<torch::Tensor> params, OptimizerKind kind, double lr, double momentum)
    : torch::optim::Optimizer({torch::optim::OptimizerParamGroup(params)},
                              std::make_unique<torch::optim::SGDOptions>(lr)) {
  for (const auto& p : params) {
    perParameter_.push_back(std::make_unique<ps::ServerOptimizer>(updateRuleOf(kind), lr, momentum, size_t(p.numel())));
  }
}

LazyOptimizer::~LazyOptimizer() = default;

torch::Tensor LazyOptimizer::step(LossClosure closure) {
  torch::NoGradGuard noGrad;
  torch::Tensor loss;
  if (closure) loss = closure();
  const auto& params = param_groups().front().params();
  for (size_t i = 0; i < params.size(); ++i) {
    const torch::Tensor& p = params[i];
    const torch::Tensor& g = p.grad();
    if (!g.defined()) continue;
    COHORT_CHECK(p.device().is_cpu(), InvalidArgument, "the lazy optimizer of a sparse model updates host memory; "
                 "parameter ", i, " is on ", p.device(), ": train a sparse model with --device cpu");
    ps::ServerOptimizer& opt = *perParameter_[i];
    opt.beginStep();
    float* values = p.data_ptr<float>();
    if (!g.is_sparse()) {
      const torch::Tensor dense = g.contiguous();
      opt.applyPart(0, {values, size_t(p.numel())}, {dense.data_ptr<float>(), size_t(dense.numel())}, 1.0f);
      continue;
    }
    const auto [rows, rowValues] = gradientRows(g);
    const size_t dim = size_t(p.numel() / p.size(0));
    const int64_t* row = rows.data_ptr<int64_t>();
    const float* v = rowValues.data_ptr<float>();
    for (int64_t j = 0; j < rows.numel(); ++j) {
      const size_t at = size_t(row[j]) * dim;
      opt.applyPart(at, {values + at, dim}, {v + size_t(j) * dim, dim}, 1.0f);
    }
  }
  return loss;
}

void LazyOptimizer::save(torch::serialize::OutputArchive& archive) const {
  for (size_t i = 0; i < perParameter_.size(); ++i) {
    auto& opt = *perParameter_[i];
    archive.write("steps." + std::to_string(i), c10::IValue(opt.steps()));
    for (size_t s = 0; s < opt.slots().size(); ++s) {
      auto& slot = opt.slots()[s];
      archive.write("slot." + std::to_string(i) + "." + std::to_string(s),
                    torch::from_blob(slot.data(), {int64_t(slot.size())}, torch::kFloat32).clone());
    }
  }
}

void LazyOptimizer::load(torch::serialize::InputArchive& archive) {
  for (size_t i = 0; i < perParameter_.size(); ++i) {
    auto& opt = *perParameter_[i];
    c10::IValue steps;
    archive.read("steps." + std::to_string(i), steps);
    opt.steps() = steps.toInt();
    for (size_t s = 0; s < opt.slots().size(); ++s) {
      torch::Tensor t;
      archive.read("slot." + std::to_string(i) + "." + std::to_string(s), t);
      auto& slot = opt.slots()[s];
      TORCH_CHECK(t.numel() == int64_t(slot.size()), "optimizer state of the wrong size");
      std::memcpy(slot.data(), t.contiguous().data_ptr<float>(), slot.size() * sizeof(float));
    }
  }
}

}  // namespace cohort
