// The optimizers a shard runs on its flat values, with torch::optim's semantics so that a
// parameter server with plain SGD matches allreduce training: sgd (p -= lr g), momentum
// (b = m b + g, the first step b = g; p -= lr b), adam (torch's defaults: betas 0.9 / 0.999,
// eps 1e-8, bias correction), adagrad (torch's defaults: s += g^2; p -= lr g / (sqrt(s) + 1e-10)).
//
// Lazy (row-sparse) updates: a step that touches only some rows of a table is beginStep() and
// then applyPart() on each touched row alone. The state of untouched rows is left as it is (no
// momentum decay, no Adam moment decay), as TensorFlow's LazyAdam and torch's SparseAdam do;
// Adam's bias correction counts every step of the optimizer.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace cohort::ps {

// The update rules a shard runs. The wire carries them as wire::Optimizer (ps/wire.h converts),
// the trainer's lazy optimizer maps its OptimizerKind to one; inside, the code compares rules.
enum class UpdateRule { kSgd, kMomentum, kAdam, kAdagrad };

class ServerOptimizer {
 public:
  ServerOptimizer(UpdateRule rule, double lr, double momentum, size_t size);

  // Applies gradient g (scaled by `scale`) to all of values: one optimizer step.
  void apply(std::span<float> values, std::span<const float> g, float scale = 1.0f) {
    beginStep();
    applyPart(0, values, g, scale);
  }

  // The same in parts: beginStep(), then applyPart() for each run of elements, where `offset` is
  // the run's first element (so the right optimizer state is used).
  void beginStep() { ++steps_; }
  void applyPart(size_t offset, std::span<float> values, std::span<const float> g, float scale) {
    applyPartAtStep(offset, values, g, scale, steps_);
  }
  // The same as the `step`-th step of these elements (1 for the first), whatever steps() says:
  // for a caller that counts steps per run of elements (a shard, per piece).
  void applyPartAtStep(size_t offset, std::span<float> values, std::span<const float> g, float scale, int64_t step);

  // Per-element state vectors the rule keeps: sgd 0, momentum and adagrad 1, adam 2.
  static int slotCount(UpdateRule rule);

  UpdateRule rule() const { return rule_; }
  void setLr(double lr) { lr_ = lr; }
  // The optimizer's per-element state (momentum, adagrad: 1 slot, adam: 2) and step count, for checkpoints.
  std::vector<std::vector<float>>& slots() { return slots_; }
  int64_t& steps() { return steps_; }

 private:
  UpdateRule rule_;
  double lr_;
  double momentum_;
  // Per element, as many as the optimizer needs (slotCount).
  std::vector<std::vector<float>> slots_;
  int64_t steps_ = 0;
};

}  // namespace cohort::ps
