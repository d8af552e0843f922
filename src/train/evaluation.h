// Scores of a classifier on a data set: loss, accuracy, macro-F1 and per-class accuracy, from the
// outputs of any forward pass (a model, a strategy's pipeline, an ensemble, a quantized model).
#pragma once

#include <cohort/data.h>
#include <cohort/metrics.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace cohort {

struct Scores {
  int64_t examples = 0;
  double loss = 0;      // mean cross-entropy
  double accuracy = 0;  // argmax == label
  double macroF1 = 0;   // mean over classes present in labels or predictions of 2PR / (P + R)
  std::vector<double> perClassAccuracy;  // recall of each class; NaN for a class with no example
};

// Adds up, batch by batch, what Scores needs: the cross-entropy sum and the confusion matrix.
class ScoreAccumulator {
 public:
  explicit ScoreAccumulator(int64_t classes);

  // logits: [B, classes] (any values whose log_softmax are the log-probabilities: an ensemble
  // passes the log of its averaged probabilities); targets: [B] int64. Either may be on any device.
  void add(const torch::Tensor& logits, const torch::Tensor& targets);
  Scores scores() const;
  // What scores() is made of, for processes that scored slices of one set to add up
  // (scoresFromConfusion of the sums is the whole set's).
  const std::vector<int64_t>& confusion() const { return confusion_; }
  double lossSum() const { return lossSum_; }

 private:
  int64_t classes_;
  double lossSum_ = 0;
  int64_t examples_ = 0;
  std::vector<int64_t> confusion_;  // [true class][predicted class]
};

// Scores from a confusion matrix ([true][predicted], row-major classes x classes). Torch-free.
Scores scoresFromConfusion(const std::vector<int64_t>& confusion, int64_t classes, double lossSum);

// A tensor assembled in host memory, on `device`: pinned and copied without blocking the host (the
// copy is ordered on the device's current stream); a CPU device or an undefined tensor as it is.
torch::Tensor onDevice(const torch::Tensor& t, const c10::Device& device);

// Runs `forward` over `data` in batches of `batch` and scores the outputs. The inputs go to
// `device` (where the model is); the outputs may be on any device.
Scores scoreDataset(const std::function<torch::Tensor(const torch::Tensor& inputs)>& forward, const Dataset& data,
                    int64_t classes, int64_t batch = 1000, const c10::Device& device = c10::Device(c10::kCPU));

// The fields an eval or done event carries for a set of scores: `prefix`accuracy, `prefix`loss,
// `prefix`macro_f1, and with perClass `prefix`per_class_accuracy.
MetricFields scoreFields(const std::string& prefix, const Scores& scores, bool perClass);

}  // namespace cohort
