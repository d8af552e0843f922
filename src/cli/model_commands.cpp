// `cohort ensemble` and `cohort quantize`: what is done with trained models after training.
#include "base/clock.h"
#include "base/stats.h"
#include "train/evaluation.h"
#include "train/model_file.h"
#include "train/threads.h"
#include <cohort/data.h>
#include <cohort/device.h>
#include <cohort/error.h>
#include <cohort/metrics.h>

#include "base/files.h"
#include "cli/commands.h"

#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <numeric>
#include <optional>

namespace cohort::cli {

namespace {

struct DataFlags {
  std::string data = "fashion-mnist";
  int64_t validation = 0;
  uint64_t validationSeed = 1;
  uint64_t seed = 1;
  int threads = 0;
  std::string metricsPath;
};

void addDataFlags(CLI::App* command, DataFlags& f) {
  command->add_option("--data", f.data, "fashion-mnist, mnist:DIR or synthetic[:N] (as the models were trained on)")
      ->capture_default_str();
  command->add_option("--validation", f.validation,
                      "The training run's --validation N: the same held-out examples are the validation set")
      ->capture_default_str();
  command->add_option("--validation-seed", f.validationSeed, "The training run's --validation-seed")
      ->capture_default_str();
  command->add_option("--seed", f.seed, "The training run's --seed (synthetic data depends on it)")
      ->capture_default_str();
  command->add_option("--threads", f.threads, "Intra-op threads (0: the idle cores of this host)")->capture_default_str();
  command->add_option("--metrics", f.metricsPath, "Write the results as JSON lines to this file");
}

DataSplits loadSplits(const DataFlags& f) {
  setComputeThreads(f.threads);
  DataSplits data = loadData(f.data, f.seed);
  holdOutValidation(data, f.validation, f.validationSeed);
  return data;
}

void checkFitsData(const ModelFile& m, const DataSplits& data) {
  COHORT_CHECK(!data.bags(), InvalidArgument, m.path, " takes images, and --data ", data.name,
               " is bags of ids (model files hold image models only): give the data it was trained on");
  COHORT_CHECK(m.shape.channels == data.channels() && m.shape.height == data.height() &&
                   m.shape.width == data.width() && m.shape.classes == data.classes,
               InvalidArgument, m.path, " takes ", m.shape.channels, "x", m.shape.height, "x", m.shape.width,
               " images into ", m.shape.classes, " classes, but --data ", data.name, " has ", data.channels(), "x",
               data.height(), "x", data.width(), " images and ", data.classes, " classes: give the data it was "
               "trained on");
}

std::string format(double v) {
  char text[32];
  std::snprintf(text, sizeof(text), "%.4f", v);
  return text;
}

// ----------------------------------------------------------------------------------------------
// ensemble

struct EnsembleScores {
  std::vector<Scores> models;
  Scores ensemble;
};

// Each model's scores and those of the mean of their softmax outputs, on one data set. The models
// are on `device`; the batches go there.
EnsembleScores scoreEnsemble(std::vector<ModelFile>& models, const Dataset& set, int64_t classes,
                             const c10::Device& device) {
  torch::NoGradGuard noGrad;
  std::vector<ScoreAccumulator> each(models.size(), ScoreAccumulator(classes));
  ScoreAccumulator mean(classes);
  const double logCount = std::log(double(models.size()));
  constexpr int64_t kBatch = 1000;
  std::vector<int64_t> idx;
  for (int64_t start = 0; start < set.size(); start += kBatch) {
    idx.resize(size_t(std::min(kBatch, set.size() - start)));
    std::iota(idx.begin(), idx.end(), start);
    Batch batch = makeBatch(set, idx);
    const torch::Tensor inputs = onDevice(batch.inputs, device);
    std::vector<torch::Tensor> logProbs;
    for (size_t k = 0; k < models.size(); ++k) {
      torch::Tensor logits = models[k].model->forward(inputs);
      each[k].add(logits, batch.targets);
      logProbs.push_back(torch::log_softmax(logits, 1));
    }
    // log(mean_k p_k) = logsumexp_k(log p_k) - log K: no probability is rounded to 0 first.
    mean.add(torch::logsumexp(torch::stack(logProbs), 0) - logCount, batch.targets);
  }
  EnsembleScores out;
  for (const auto& a : each) out.models.push_back(a.scores());
  out.ensemble = mean.scores();
  return out;
}

int runEnsemble(const std::vector<std::string>& paths, const std::string& deviceName, const DataFlags& f) {
  COHORT_CHECK(!paths.empty(), InvalidArgument, "no model given: cohort ensemble A.pt B.pt ...");
  const c10::Device device = resolveDevice(deviceName);
  std::vector<ModelFile> models;
  for (const std::string& path : paths) {
    models.push_back(loadModelFile(path));  // read on the CPU, whatever device wrote it
    models.back().model->to(device);
    const ModelFile& m = models.back();
    COHORT_CHECK(m.shape.classes == models.front().shape.classes, InvalidArgument, m.path, " has ", m.shape.classes,
                 " outputs but ", models.front().path, " has ", models.front().shape.classes,
                 ": an ensemble averages models with the same outputs");
  }
  const DataSplits data = loadSplits(f);
  for (const ModelFile& m : models) checkFitsData(m, data);
  std::optional<EnsembleScores> val;
  if (data.validation.size() > 0) val = scoreEnsemble(models, data.validation, data.classes, device);
  const EnsembleScores test = scoreEnsemble(models, data.test, data.classes, device);

  MetricsWriter metrics(f.metricsPath);
  auto fields = [&](const Scores& t, const Scores* v) {
    MetricFields out;
    if (v != nullptr) {
      MetricFields vf = scoreFields("val_", *v, false);
      out.insert(out.end(), vf.begin(), vf.end());
    }
    MetricFields tf = scoreFields("test_", t, true);
    out.insert(out.end(), tf.begin(), tf.end());
    return out;
  };
  size_t width = 8;
  for (const auto& p : paths) width = std::max(width, p.size());
  std::printf("%-*s  %10s  %10s  %10s  %10s\n", int(width), "model", "val acc", "test acc", "test loss", "test F1");
  for (size_t k = 0; k < models.size(); ++k) {
    const Scores* v = val ? &val->models[k] : nullptr;
    MetricFields line{{"path", paths[k]}};
    MetricFields scores = fields(test.models[k], v);
    line.insert(line.end(), scores.begin(), scores.end());
    metrics.write("model", line);
    std::printf("%-*s  %10s  %10s  %10s  %10s\n", int(width), paths[k].c_str(), v ? format(v->accuracy).c_str() : "-",
                format(test.models[k].accuracy).c_str(), format(test.models[k].loss).c_str(),
                format(test.models[k].macroF1).c_str());
  }
  MetricFields line{{"models", int64_t(models.size())},
                    {"paths",
                     [&] {
                       std::string all;
                       for (const auto& p : paths) all += (all.empty() ? "" : ",") + p;
                       return all;
                     }()},
                    {"device", device.str()}};
  MetricFields scores = fields(test.ensemble, val ? &val->ensemble : nullptr);
  line.insert(line.end(), scores.begin(), scores.end());
  metrics.write("ensemble", line);
  std::printf("%-*s  %10s  %10s  %10s  %10s\n", int(width), "ensemble",
              val ? format(val->ensemble.accuracy).c_str() : "-", format(test.ensemble.accuracy).c_str(),
              format(test.ensemble.loss).c_str(), format(test.ensemble.macroF1).c_str());
  return 0;
}

// ----------------------------------------------------------------------------------------------
// quantize

// Seconds for one inference pass over the set in batches of `batch`.
double timePass(torch::nn::Sequential& model, const Dataset& set, int64_t batch) {
  torch::NoGradGuard noGrad;
  std::vector<int64_t> idx;
  const auto start = Clock::now();
  for (int64_t at = 0; at < set.size(); at += batch) {
    idx.resize(size_t(std::min(batch, set.size() - at)));
    std::iota(idx.begin(), idx.end(), at);
    Batch b = makeBatch(set, idx);
    model->forward(b.inputs);
  }
  return secondsSince(start);
}

int runQuantize(const std::string& path, const std::string& outPath, int repeats, int64_t batch, const DataFlags& f) {
  COHORT_CHECK(!outPath.empty(), InvalidArgument, "cohort quantize needs --out FILE for the 8-bit model");
  COHORT_CHECK(repeats >= 1, InvalidArgument, "--repeat must be at least 1, got ", repeats);
  COHORT_CHECK(batch >= 1, InvalidArgument, "--batch must be at least 1, got ", batch);
  checkOutputPath("--out", outPath);
  std::error_code error;
  COHORT_CHECK(!std::filesystem::equivalent(path, outPath, error), InvalidArgument, "--out ", outPath, " is ", path,
               ", the model to quantize: write the 8-bit model to another file");
  ModelFile floatModel = loadModelFile(path);
  COHORT_CHECK(!floatModel.quantized, InvalidArgument, path, " is already quantized: give the float model");
  const DataSplits data = loadSplits(f);
  checkFitsData(floatModel, data);
  const int layers = quantizeModelFile(floatModel, outPath);
  COHORT_CHECK(layers > 0, InvalidArgument, path, " (", floatModel.spec,
               ") has no torch::nn::Linear layer to quantize");
  ModelFile q = loadModelFile(outPath);
  const Scores dequantized = scoreDataset([&](const torch::Tensor& x) { return q.model->forward(x); }, data.test,
                                          data.classes);
  const int kernels = useQuantizedKernels(q);
  const std::string engine = kernels > 0 ? quantizedEngine() : "none (int8 weights dequantized to float)";
  const Scores floatScores =
      scoreDataset([&](const torch::Tensor& x) { return floatModel.model->forward(x); }, data.test, data.classes);
  const Scores int8Scores =
      scoreDataset([&](const torch::Tensor& x) { return q.model->forward(x); }, data.test, data.classes);
  // Alternating passes, so that both models see the same machine; the median of each.
  std::vector<double> floatSeconds, int8Seconds;
  timePass(floatModel.model, data.test, batch);  // warm-up
  timePass(q.model, data.test, batch);
  for (int r = 0; r < repeats; ++r) {
    floatSeconds.push_back(timePass(floatModel.model, data.test, batch));
    int8Seconds.push_back(timePass(q.model, data.test, batch));
  }
  const auto floatBytes = int64_t(std::filesystem::file_size(path));
  const auto int8Bytes = int64_t(std::filesystem::file_size(outPath));
  const double tf = median(floatSeconds);
  const double tq = median(int8Seconds);
  const double examples = double(data.test.size());
  std::printf("quantized %d Linear layers of %s to int8 (per-channel, symmetric): %s\n", layers,
              floatModel.spec.c_str(), outPath.c_str());
  std::printf("kernel: %s\n", engine.c_str());
  std::printf("%-10s  %12s  %10s  %10s  %14s\n", "", "bytes", "test acc", "test loss", "examples/s");
  std::printf("%-10s  %12lld  %10s  %10s  %14.0f\n", "float", (long long)floatBytes,
              format(floatScores.accuracy).c_str(), format(floatScores.loss).c_str(), examples / tf);
  std::printf("%-10s  %12lld  %10s  %10s  %14.0f\n", "int8", (long long)int8Bytes, format(int8Scores.accuracy).c_str(),
              format(int8Scores.loss).c_str(), examples / tq);
  std::printf("size ratio %.3f, accuracy change %+.2f points, inference speed-up %.2fx (batch %lld, median of %d)\n",
              double(int8Bytes) / double(floatBytes), 100 * (int8Scores.accuracy - floatScores.accuracy), tf / tq,
              (long long)batch, repeats);
  MetricsWriter metrics(f.metricsPath);
  metrics.write("quantize", {{"model", path},
                             {"out", outPath},
                             {"layers_quantized", int64_t(layers)},
                             {"kernel", engine},
                             {"float_bytes", floatBytes},
                             {"int8_bytes", int8Bytes},
                             {"size_ratio", double(int8Bytes) / double(floatBytes)},
                             {"float_test_accuracy", floatScores.accuracy},
                             {"int8_test_accuracy", int8Scores.accuracy},
                             {"dequantized_test_accuracy", dequantized.accuracy},
                             {"float_test_loss", floatScores.loss},
                             {"int8_test_loss", int8Scores.loss},
                             {"accuracy_change", int8Scores.accuracy - floatScores.accuracy},
                             {"float_examples_per_s", examples / tf},
                             {"int8_examples_per_s", examples / tq},
                             {"speedup", tf / tq},
                             {"batch", batch},
                             {"float_seconds", floatSeconds},
                             {"int8_seconds", int8Seconds}});
  return 0;
}

}  // namespace

Run addEnsembleCommand(CLI::App& app) {
  auto flags = std::make_shared<DataFlags>();
  auto paths = std::make_shared<std::vector<std::string>>();
  auto device = std::make_shared<std::string>("auto");
  CLI::App* command = app.add_subcommand(
      "ensemble", "Evaluate the average of the softmax outputs of saved models (cohort train --save-model)");
  command->option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  command->add_option("models", *paths, "Model files written by cohort train --save-model")->required();
  command
      ->add_option("--device", *device,
                   "Where the models run: auto (the first GPU when there is one, else the CPU), cpu, cuda, "
                   "cuda:N")
      ->capture_default_str();
  addDataFlags(command, *flags);
  command->footer(
      "Prints each model's validation and test accuracy beside the ensemble's. The models must have\n"
      "the same outputs; give --data, --validation and --validation-seed as in training. A model\n"
      "file saved on any device runs on any other.");
  return [flags, paths, device]() { return runEnsemble(*paths, *device, *flags); };
}

Run addQuantizeCommand(CLI::App& app) {
  auto flags = std::make_shared<DataFlags>();
  auto path = std::make_shared<std::string>();
  auto out = std::make_shared<std::string>();
  auto repeats = std::make_shared<int>(5);
  auto batch = std::make_shared<int64_t>(1000);
  CLI::App* command = app.add_subcommand(
      "quantize", "Post-training 8-bit quantization of a saved model's Linear layers; reports size, accuracy, speed");
  command->option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  command->add_option("model", *path, "A model file written by cohort train --save-model")->required();
  command->add_option("--out", *out, "Write the 8-bit model here")->required();
  command->add_option("--repeat", *repeats, "Timed inference passes over the test set per model")
      ->capture_default_str();
  command->add_option("--batch", *batch, "Inference batch size for the timing")->capture_default_str();
  addDataFlags(command, *flags);
  command->footer(
      "Linear weights become int8 with one scale per output row (symmetric). Inference uses libtorch's\n"
      "dynamic int8 kernel (quantized::linear_dynamic) where this libtorch has an engine for it\n"
      "(onednn, fbgemm or qnnpack), else the int8 weights are dequantized to float at load. It runs\n"
      "on the CPU, where those kernels are, and reads a model saved on any device.");
  return [flags, path, out, repeats, batch]() { return runQuantize(*path, *out, *repeats, *batch, *flags); };
}

}  // namespace cohort::cli
