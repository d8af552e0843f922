// The Trainer's evaluation: the model's scores on the test set and the held-out validation set, on
// every process that joins evaluation (the strategy says which), and the chief's record of them
// (the eval event's scores, TensorBoard's scalars, the progress line).
#include "train/trainer_internal.h"

#include <cmath>
#include <cstdio>
#include <limits>
#include <numeric>

namespace cohort {

namespace {

constexpr int64_t kEvalBatch = 1000;

}  // namespace

// On every process that joins evaluation (strategy->joinsEvaluation()); the result is the
// chief's. The test set, then the validation set, in the same order on every process.
Trainer::State::Eval Trainer::State::evaluate() {
  torch::NoGradGuard noGrad;
  model->eval();
  Eval ev;
  ev.test = evaluateOn(data.test);
  if (data.validation.size() > 0) ev.validation = evaluateOn(data.validation);
  model->train();
  return ev;
}

// Under a scheme whose processes hold one model (Strategy::evaluationGroup), each scores its
// slice of `set` and the counts are summed over them: every process returns the whole set's scores.
Scores Trainer::State::evaluateOn(const Dataset& set) {
  const int64_t n = set.size();
  const std::shared_ptr<Communicator> group = strategy->evaluationGroup();
  const int64_t parts = group ? group->worldSize() : 1;
  const int64_t part = group ? group->rank() : 0;
  const int64_t first = n * part / parts;
  const int64_t end = n * (part + 1) / parts;
  ScoreAccumulator acc(data.classes);
  double lossSum = 0;  // with options.evaluate
  double metricSum = 0;
  std::vector<int64_t> idx;
  for (int64_t start = first; start < end; start += kEvalBatch) {
    const int64_t count = std::min(kEvalBatch, end - start);
    idx.resize(size_t(count));
    std::iota(idx.begin(), idx.end(), start);
    Batch batch = makeBatch(set, idx);
    auto out = strategy->infer(model, onDevice(batch.inputs, device));  // the targets stay on the host
    if (!out.defined()) continue;                                       // the chief has the outputs
    out = out.to(torch::kCPU);
    if (options.evaluate) {
      const auto [loss, metric] = options.evaluate(out, batch.targets);
      lossSum += loss;
      metricSum += metric;
    } else {
      acc.add(out, batch.targets);
    }
  }
  std::vector<int64_t> confusion = acc.confusion();
  if (!options.evaluate) lossSum = acc.lossSum();
  if (group) {
    // One sum of every count (exact in a double below 2^53 examples) and the loss and metric sums.
    std::vector<double> counts(confusion.begin(), confusion.end());
    counts.push_back(lossSum);
    counts.push_back(metricSum);
    torch::Tensor sums = torch::from_blob(counts.data(), {int64_t(counts.size())}, torch::kFloat64).clone();
    group->allreduce(sums);
    const double* summed = sums.data_ptr<double>();
    for (size_t i = 0; i < confusion.size(); ++i) confusion[i] = int64_t(std::llround(summed[i]));
    lossSum = summed[confusion.size()];
    metricSum = summed[confusion.size() + 1];
  }
  if (!options.evaluate) return scoresFromConfusion(confusion, data.classes, lossSum);
  Scores custom;  // the injected metric has no classes: no F1, no per-class figures
  custom.examples = n;
  custom.loss = lossSum / double(n);
  custom.accuracy = metricSum / double(n);
  custom.macroF1 = std::numeric_limits<double>::quiet_NaN();
  return custom;
}

MetricFields Trainer::State::evalFields(const Eval& ev) const {
  // The epoch of the last step: at an epoch's end the loop has counted the next one already.
  const int64_t stepEpoch = stepInEpoch == 0 && step > 0 ? epoch - 1 : epoch;
  MetricFields fields{{"step", step}, {"epoch", stepEpoch}};
  MetricFields scores = scoreFields("", ev.test, false);
  fields.insert(fields.end(), scores.begin(), scores.end());
  if (ev.validation) {
    MetricFields v = scoreFields("val_", *ev.validation, false);
    fields.insert(fields.end(), v.begin(), v.end());
  }
  return fields;
}

void Trainer::State::boardEval(const Eval& ev) {
  if (!board) return;
  std::vector<std::pair<std::string, float>> scalars{{"test/accuracy", float(ev.test.accuracy)},
                                                     {"test/loss", float(ev.test.loss)},
                                                     {"test/macro_f1", float(ev.test.macroF1)}};
  if (ev.validation) {
    scalars.emplace_back("validation/accuracy", float(ev.validation->accuracy));
    scalars.emplace_back("validation/loss", float(ev.validation->loss));
  }
  board->scalars(step, scalars);
}

std::string Trainer::State::evalMessage(const Eval& ev) const {
  char text[200];
  if (ev.validation) {
    std::snprintf(text, sizeof(text), "eval at step %lld: test accuracy %.4f, loss %.4f; validation accuracy %.4f",
                  (long long)step, ev.test.accuracy, ev.test.loss, ev.validation->accuracy);
  } else {
    std::snprintf(text, sizeof(text), "eval at step %lld: test accuracy %.4f, loss %.4f", (long long)step,
                  ev.test.accuracy, ev.test.loss);
  }
  return text;
}

}  // namespace cohort
