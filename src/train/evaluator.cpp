#include "train/evaluator.h"

#include <cohort/checkpoint.h>
#include <cohort/error.h>
#include <cohort/metrics.h>
#include <cohort/models.h>
#include "base/clock.h"
#include "base/tensorboard.h"
#include "train/evaluation.h"
#include "train/threads.h"

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

namespace cohort {

namespace fs = std::filesystem;

namespace {

std::string readAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// Drops a last line that a kill cut short, so that appending goes on after a whole line.
void trimPartialLine(const std::string& path) {
  const std::string text = readAll(path);
  if (text.empty() || text.back() == '\n') return;
  const size_t keep = text.rfind('\n') == std::string::npos ? 0 : text.rfind('\n') + 1;
  std::error_code ec;
  fs::resize_file(path, keep, ec);
  COHORT_CHECK(!ec, IoError, path, ": cannot drop the incomplete last line: ", ec.message());
}

// The model, loaded from a trainer checkpoint's payload (the archive Trainer writes).
void loadCheckpointModel(const std::vector<uint8_t>& payload, const std::string& path, const TrainOptions& o,
                         torch::nn::Sequential& model) {
  try {
    torch::serialize::InputArchive archive;
    archive.load_from(reinterpret_cast<const char*>(payload.data()), payload.size(), torch::Device(torch::kCPU));
    c10::IValue fingerprint;
    archive.read("fingerprint", fingerprint);
    const std::string expected = "model=" + o.model + " data=" + o.data + " ";
    COHORT_CHECK(fingerprint.toStringRef().rfind(expected, 0) == 0, InvalidArgument, path,
                 ": checkpoint is of another model or data set (", fingerprint.toStringRef(),
                 "): run the evaluator with the workers' --model and --data");
    torch::serialize::InputArchive modelArchive;
    archive.read("model", modelArchive);
    model->load(modelArchive);
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {  // c10::Error, or TorchScript's own for a garbled archive
    std::string what = e.what();
    throw IoError(path + ": checkpoint does not fit this model: " + what.substr(0, what.find('\n')));
  }
}

}  // namespace

std::string evaluatorRecordPath(const std::string& checkpointDir, int index) {
  return checkpointDir + "/evaluator-" + std::to_string(index) + ".jsonl";
}

std::string trainingDoneMarkerPath(const std::string& checkpointDir) { return checkpointDir + "/training-done"; }

std::set<int64_t> evaluatedSteps(const std::string& checkpointDir, int index) {
  std::set<int64_t> steps;
  std::istringstream lines(readAll(evaluatorRecordPath(checkpointDir, index)));
  for (std::string line; std::getline(lines, line);) {
    const nlohmann::json event = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (event.is_object() && event.value("event", "") == "eval" && event.contains("step") &&
        event["step"].is_number_integer()) {
      steps.insert(event["step"].get<int64_t>());
    }
  }
  return steps;
}

int64_t evaluatedByAll(const std::string& checkpointDir, int evaluators) {
  int64_t upTo = INT64_MAX;
  for (int k = 0; k < evaluators; ++k) {
    const std::set<int64_t> steps = evaluatedSteps(checkpointDir, k);
    upTo = std::min(upTo, steps.empty() ? int64_t(-1) : *steps.rbegin());
  }
  return upTo;
}

void writeTrainingDone(const std::string& checkpointDir, int64_t step) {
  const std::string path = trainingDoneMarkerPath(checkpointDir);
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << nlohmann::json{{"step", step}}.dump() << "\n";
    COHORT_CHECK(out.good(), IoError, tmp, ": cannot write the end-of-training marker: ", std::strerror(errno));
  }
  COHORT_CHECK(::rename(tmp.c_str(), path.c_str()) == 0, IoError, path,
               ": cannot rename the end-of-training marker into place: ", std::strerror(errno));
}

std::optional<int64_t> readTrainingDone(const std::string& checkpointDir) {
  const std::string path = trainingDoneMarkerPath(checkpointDir);
  if (!fs::exists(path)) return std::nullopt;
  const nlohmann::json marker = nlohmann::json::parse(readAll(path), nullptr, false);
  COHORT_CHECK(marker.is_object() && marker.contains("step") && marker["step"].is_number_integer(), IoError, path,
               ": not an end-of-training marker ({\"step\": N}): remove it");
  return marker["step"].get<int64_t>();
}

void removeTrainingDone(const std::string& checkpointDir) {
  std::error_code ec;
  fs::remove(trainingDoneMarkerPath(checkpointDir), ec);
}

int runEvaluator(const TrainOptions& o, const ClusterSpec& cluster, const EvaluatorOptions& eo) {
  COHORT_CHECK(!o.checkpointDir.empty(), InvalidArgument, "this process is evaluator ", cluster.rank,
               ", which evaluates the checkpoints the chief writes, but no --checkpoint-dir was given: "
               "give the workers' --checkpoint-dir");
  COHORT_CHECK(o.strategy.scheme != Scheme::kPipeline && o.strategy.scheme != Scheme::kPs, InvalidArgument,
               "an evaluator task reads whole-model checkpoints, which --strategy ", schemeName(o.strategy.scheme),
               " does not write (it checkpoints per ", o.strategy.scheme == Scheme::kPs ? "shard" : "stage",
               "): drop the evaluator task");
  const char* ompThreads = std::getenv("OMP_NUM_THREADS");
  setComputeThreads(o.threads > 0 ? o.threads : ompThreads != nullptr && std::atoi(ompThreads) > 0 ? std::atoi(ompThreads) : 1);
  torch::manual_seed(o.seed);
  DataSplits data = loadData(o.data, o.seed);
  holdOutValidation(data, o.validation, o.validationSeed);
  torch::nn::Sequential model =
      makeModel(o.model, {data.channels(), data.height(), data.width(), data.classes});
  model->eval();

  const std::string& dir = o.checkpointDir;
  CheckpointStore store(dir);
  const std::string recordPath = evaluatorRecordPath(dir, cluster.rank);
  if (fs::exists(recordPath)) trimPartialLine(recordPath);
  std::set<int64_t> done = evaluatedSteps(dir, cluster.rank);
  if (!done.empty()) {
    std::fprintf(stderr, "cohort: evaluator %d: %zu checkpoints already recorded in %s (last: step %lld)\n",
                 cluster.rank, done.size(), recordPath.c_str(), (long long)*done.rbegin());
  }
  MetricsWriter record(recordPath, /*append=*/true);
  std::unique_ptr<TensorBoardWriter> board;
  if (!o.tensorboardDir.empty()) board = std::make_unique<TensorBoardWriter>(o.tensorboardDir + "/eval");

  const auto start = Clock::now();
  auto lastProgress = Clock::now();
  std::set<int64_t> unreadable;  // reported once each
  int64_t evaluatedNow = 0;
  for (;;) {
    // Read the marker before listing: a checkpoint listed after it was written is complete.
    const std::optional<int64_t> finalStep = readTrainingDone(dir);
    std::vector<CheckpointFile> files = store.list();
    std::reverse(files.begin(), files.end());  // oldest first
    for (const CheckpointFile& file : files) {
      if (done.count(file.step) != 0 || unreadable.count(file.step) != 0) continue;
      std::vector<uint8_t> payload;
      try {
        payload = CheckpointStore::readVerified(file.path);
      } catch (const IoError& e) {
        if (!fs::exists(file.path)) continue;  // pruned since it was listed
        std::fprintf(stderr, "cohort: warning: evaluator %d: %s; skipping it\n", cluster.rank, e.what());
        unreadable.insert(file.step);
        continue;
      }
      loadCheckpointModel(payload, file.path, o, model);
      const auto evalStart = Clock::now();
      auto forward = [&](const torch::Tensor& x) { return model->forward(x); };
      const Scores test = scoreDataset(forward, data.test, data.classes);
      MetricFields fields{{"step", file.step}};
      MetricFields scores = scoreFields("", test, false);
      fields.insert(fields.end(), scores.begin(), scores.end());
      std::optional<Scores> val;
      if (data.validation.size() > 0) {
        val = scoreDataset(forward, data.validation, data.classes);
        MetricFields v = scoreFields("val_", *val, false);
        fields.insert(fields.end(), v.begin(), v.end());
      }
      fields.emplace_back("eval_s", secondsSince(evalStart));
      fields.emplace_back("wall_s", secondsSince(start));
      fields.emplace_back("checkpoint", file.path);
      fields.emplace_back("evaluator", int64_t(cluster.rank));
      record.write("eval", fields);
      if (board) {
        std::vector<std::pair<std::string, float>> scalars{{"test/accuracy", float(test.accuracy)},
                                                           {"test/loss", float(test.loss)},
                                                           {"test/macro_f1", float(test.macroF1)}};
        if (val) {
          scalars.emplace_back("validation/accuracy", float(val->accuracy));
          scalars.emplace_back("validation/loss", float(val->loss));
        }
        board->scalars(file.step, scalars);
      }
      std::fprintf(stderr, "cohort: evaluator %d: step %lld: test accuracy %.4f, loss %.4f\n", cluster.rank,
                   (long long)file.step, test.accuracy, test.loss);
      done.insert(file.step);
      ++evaluatedNow;
      if (eo.testKillAfter > 0 && int64_t(done.size()) == eo.testKillAfter) ::raise(SIGKILL);
      lastProgress = Clock::now();
    }
    if (finalStep) {
      bool pending = false;
      for (const CheckpointFile& file : store.list()) {
        if (file.step <= *finalStep && done.count(file.step) == 0 && unreadable.count(file.step) == 0) pending = true;
      }
      if (!pending) {
        record.write("done", {{"final_step", *finalStep},
                              {"evaluated", int64_t(done.size())},
                              {"evaluated_by_this_process", evaluatedNow},
                              {"wall_s", secondsSince(start)}});
        std::fprintf(stderr, "cohort: evaluator %d: training ended at step %lld; %zu checkpoints evaluated\n",
                     cluster.rank, (long long)*finalStep, done.size());
        return 0;
      }
      continue;
    }
    COHORT_CHECK(secondsSince(lastProgress) < eo.idleTimeoutSeconds, TimeoutError, "evaluator ", cluster.rank,
                 ": no new checkpoint in ", dir, " for ", eo.idleTimeoutSeconds,
                 " s and no end-of-training marker: is the chief running with this --checkpoint-dir? "
                 "(--evaluator-timeout sets the wait)");
    std::this_thread::sleep_for(std::chrono::duration<double>(eo.pollSeconds));
  }
}

}  // namespace cohort
