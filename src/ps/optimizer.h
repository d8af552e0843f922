// The optimizers a shard runs on its flat values, with torch::optim's semantics so that a
// parameter server with plain SGD matches allreduce training: sgd (p -= lr g), momentum
// (b = m b + g, the first step b = g; p -= lr b), adam (torch's defaults: betas 0.9 / 0.999,
// eps 1e-8, bias correction).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace cohort::ps {

class ServerOptimizer {
 public:
  // Throws InvalidArgument for an unknown name.
  ServerOptimizer(std::string name, double lr, double momentum, size_t size);

  // Applies gradient g (scaled by `scale`) to all of values: one optimizer step.
  void apply(std::span<float> values, std::span<const float> g, float scale = 1.0f) {
    beginStep();
    applyPart(0, values, g, scale);
  }

  // The same in parts: beginStep(), then applyPart() for each run of elements, where `offset` is
  // the run's first element (so the right optimizer state is used).
  void beginStep() { ++steps_; }
  void applyPart(size_t offset, std::span<float> values, std::span<const float> g, float scale);

  const std::string& name() const { return name_; }
  void setLr(double lr) { lr_ = lr; }
  // The optimizer's per-element state (momentum: 1 slot, adam: 2) and step count, for checkpoints.
  std::vector<std::vector<float>>& slots() { return slots_; }
  int64_t& steps() { return steps_; }

 private:
  std::string name_;
  double lr_;
  double momentum_;
  std::vector<std::vector<float>> slots_;
  int64_t steps_ = 0;
};

}  // namespace cohort::ps
