// The Trainer's evaluation: the model's scores on the test set and the held-out validation set, on
// every process that joins evaluation (the strategy says which), and the chief's record of them
// (the eval event's scores, TensorBoard's scalars, the progress line).
#include "train/trainer_internal.h"

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

Scores Trainer::State::evaluateOn(const Dataset& set) {
  const int64_t n = set.size();
  ScoreAccumulator acc(data.classes);
  double lossSum = 0;  // with options.evaluate
  double metricSum = 0;
  std::vector<int64_t> idx;
  for (int64_t start = 0; start < n; start += kEvalBatch) {
    const int64_t count = std::min(kEvalBatch, n - start);
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
  if (!options.evaluate) return acc.scores();
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
