#include "ps/optimizer.h"

#include <cmath>

namespace cohort::ps {

namespace {
constexpr double kBeta1 = 0.9;
constexpr double kBeta2 = 0.999;
constexpr double kEps = 1e-8;
constexpr double kAdagradEps = 1e-10;
}  // namespace

ServerOptimizer::ServerOptimizer(UpdateRule rule, double lr, double momentum, size_t size)
    : rule_(rule), lr_(lr), momentum_(momentum) {
  slots_.assign(size_t(slotCount(rule_)), std::vector<float>(size, 0.0f));
}

int ServerOptimizer::slotCount(UpdateRule rule) {
  switch (rule) {
    case UpdateRule::kSgd: return 0;
    case UpdateRule::kMomentum:
    case UpdateRule::kAdagrad: return 1;
    case UpdateRule::kAdam: return 2;
  }
  return 0;
}

void ServerOptimizer::applyPartAtStep(size_t offset, std::span<float> p, std::span<const float> g, float scale,
                                      int64_t step) {
  const size_t n = p.size();
  const float lr = float(lr_);
  if (rule_ == UpdateRule::kSgd) {
    for (size_t i = 0; i < n; ++i) p[i] -= lr * (scale * g[i]);
    return;
  }
  if (rule_ == UpdateRule::kMomentum) {
    // torch::optim::SGD: the buffer starts as the first gradient, then b = m b + g (dampening 0).
    float* b = slots_[0].data() + offset;
    const float m = float(momentum_);
    if (step == 1) {
      for (size_t i = 0; i < n; ++i) b[i] = scale * g[i];
    } else {
      for (size_t i = 0; i < n; ++i) b[i] = m * b[i] + scale * g[i];
    }
    for (size_t i = 0; i < n; ++i) p[i] -= lr * b[i];
    return;
  }
  if (rule_ == UpdateRule::kAdagrad) {
    // torch::optim::Adagrad (lr_decay 0, initial accumulator 0): s += g^2; p -= lr g / (sqrt(s) + eps)
    float* sum = slots_[0].data() + offset;
    const float eps = float(kAdagradEps);
    for (size_t i = 0; i < n; ++i) {
      const float gi = scale * g[i];
      sum[i] += gi * gi;
      p[i] -= lr * gi / (std::sqrt(sum[i]) + eps);
    }
    return;
  }
  // adam, as torch::optim::Adam (no weight decay, no amsgrad)
  float* m1 = slots_[0].data() + offset;
  float* m2 = slots_[1].data() + offset;
  const double c1 = 1.0 - std::pow(kBeta1, double(step));
  const double c2 = 1.0 - std::pow(kBeta2, double(step));
  const float stepSize = float(lr_ / c1);
  const float sqrtC2 = float(std::sqrt(c2));
  const float b1 = float(kBeta1), b2 = float(kBeta2), eps = float(kEps);
  for (size_t i = 0; i < n; ++i) {
    const float gi = scale * g[i];
    m1[i] = b1 * m1[i] + (1 - b1) * gi;
    m2[i] = b2 * m2[i] + (1 - b2) * gi * gi;
    p[i] -= stepSize * m1[i] / (std::sqrt(m2[i]) / sqrtC2 + eps);
  }
}

}  // namespace cohort::ps
