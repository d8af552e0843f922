#include "train/evaluation.h"

#include <cohort/error.h>

#include <torch/torch.h>

#include <cmath>
#include <limits>
#include <numeric>

namespace cohort {

ScoreAccumulator::ScoreAccumulator(int64_t classes)
    : classes_(classes), confusion_(size_t(classes * classes), 0) {
  COHORT_CHECK(classes > 0, InvalidArgument, "a classifier needs at least one class, got ", classes);
}

void ScoreAccumulator::add(const torch::Tensor& outputs, const torch::Tensor& labels) {
  const torch::Tensor logits = outputs.to(torch::kCPU);  // the confusion matrix is counted on the host
  const torch::Tensor targets = labels.to(torch::kCPU);
  COHORT_CHECK(logits.dim() == 2 && logits.size(1) == classes_, InvalidArgument, "the model gives ",
               logits.dim() == 2 ? logits.size(1) : -1, " outputs per example but the data has ", classes_,
               " classes");
  lossSum_ += torch::nn::functional::cross_entropy(
                  logits, targets, torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum))
                  .item<double>();
  const torch::Tensor predicted = logits.argmax(1).to(torch::kInt64).contiguous();
  const torch::Tensor truth = targets.to(torch::kInt64).contiguous();
  const int64_t* p = predicted.data_ptr<int64_t>();
  const int64_t* t = truth.data_ptr<int64_t>();
  for (int64_t i = 0; i < truth.size(0); ++i) {
    COHORT_CHECK(t[i] >= 0 && t[i] < classes_, InvalidArgument, "label ", t[i], " is outside 0..", classes_ - 1);
    ++confusion_[size_t(t[i] * classes_ + p[i])];
  }
  examples_ += truth.size(0);
}

Scores ScoreAccumulator::scores() const { return scoresFromConfusion(confusion_, classes_, lossSum_); }

Scores scoresFromConfusion(const std::vector<int64_t>& confusion, int64_t classes, double lossSum) {
  Scores s;
  std::vector<int64_t> truePerClass(size_t(classes), 0);
  std::vector<int64_t> predictedPerClass(size_t(classes), 0);
  int64_t correct = 0;
  for (int64_t t = 0; t < classes; ++t) {
    for (int64_t p = 0; p < classes; ++p) {
      const int64_t n = confusion[size_t(t * classes + p)];
      truePerClass[size_t(t)] += n;
      predictedPerClass[size_t(p)] += n;
      s.examples += n;
      if (t == p) correct += n;
    }
  }
  if (s.examples == 0) return s;
  s.loss = lossSum / double(s.examples);
  s.accuracy = double(correct) / double(s.examples);
  double f1Sum = 0;
  int64_t present = 0;
  for (int64_t c = 0; c < classes; ++c) {
    const double tp = double(confusion[size_t(c * classes + c)]);
    const auto trueCount = double(truePerClass[size_t(c)]);
    const auto predictedCount = double(predictedPerClass[size_t(c)]);
    s.perClassAccuracy.push_back(trueCount > 0 ? tp / trueCount : std::numeric_limits<double>::quiet_NaN());
    if (trueCount == 0 && predictedCount == 0) continue;
    ++present;
    // F1 = 2PR / (P + R) = 2 TP / (true + predicted); 0 when TP is 0.
    f1Sum += 2 * tp / (trueCount + predictedCount);
  }
  s.macroF1 = present > 0 ? f1Sum / double(present) : 0.0;
  return s;
}

torch::Tensor onDevice(const torch::Tensor& t, const c10::Device& device) {
  if (device.is_cpu() || !t.defined()) return t;
  return t.pin_memory().to(device, /*non_blocking=*/true);
}

Scores scoreDataset(const std::function<torch::Tensor(const torch::Tensor&)>& forward, const Dataset& data,
                    int64_t classes, int64_t batch, const c10::Device& device) {
  torch::NoGradGuard noGrad;
  ScoreAccumulator acc(classes);
  std::vector<int64_t> idx;
  for (int64_t start = 0; start < data.size(); start += batch) {
    const int64_t count = std::min(batch, data.size() - start);
    idx.resize(size_t(count));
    std::iota(idx.begin(), idx.end(), start);
    Batch b = makeBatch(data, idx);
    acc.add(forward(onDevice(b.inputs, device)), b.targets);
  }
  return acc.scores();
}

MetricFields scoreFields(const std::string& prefix, const Scores& scores, bool perClass) {
  MetricFields fields{{prefix + "accuracy", scores.accuracy}, {prefix + "loss", scores.loss},
                      {prefix + "macro_f1", scores.macroF1}};
  if (perClass) fields.emplace_back(prefix + "per_class_accuracy", scores.perClassAccuracy);
  return fields;
}

}  // namespace cohort
