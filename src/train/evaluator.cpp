#include "train/evaluator.h"

#include "base/clock.h"
#include "base/compute_threads.h"
#include "base/crypto.h"
#include "base/files.h"
#include "base/tensorboard.h"
#include "train/evaluation.h"
#include "train/threads.h"
#include <cohort/checkpoint.h>
#include <cohort/device.h>
#include <cohort/error.h>
#include <cohort/metrics.h>
#include <cohort/models.h>

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
                         const c10::Device& device, torch::nn::Sequential& model) {
  try {
    torch::serialize::InputArchive archive;
    // Onto the model's device, whichever device wrote it, as the Trainer's restore does.
    archive.load_from(reinterpret_cast<const char*>(payload.data()), payload.size(), device);
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

// The record of evaluator `rank` in `dir`, ready to be appended to: a last line that a kill cut
// short is dropped. Returns the steps it holds.
std::set<int64_t> resumeRecord(const std::string& dir, int rank) {
  const std::string recordPath = evaluatorRecordPath(dir, rank);
  if (fs::exists(recordPath)) trimPartialLine(recordPath);
  std::set<int64_t> done = evaluatedSteps(dir, rank);
  if (!done.empty()) {
    std::fprintf(stderr, "cohort: evaluator %d: %zu checkpoints already recorded in %s (last: step %lld)\n", rank,
                 done.size(), recordPath.c_str(), (long long)*done.rbegin());
  }
  return done;
}

// The workers' data, with their --validation examples held out.
DataSplits heldOutData(const TrainOptions& o) {
  DataSplits data = loadData(o.data, o.seed);
  holdOutValidation(data, o.validation, o.validationSeed);
  return data;
}

// The workers' model on `device`, in evaluation mode: each checkpoint's parameters are loaded into it.
torch::nn::Sequential evaluationModel(const TrainOptions& o, const DataSplits& data, const c10::Device& device) {
  torch::nn::Sequential model = makeModel(o.model, inputShapeOf(data));
  model->to(device);
  model->eval();
  return model;
}

// One evaluator task's run over the chief's checkpoint directory: the data and the model it
// scores, its record, and the checkpoints it has seen. It scores on the workers' --device (its own
// GPU under "auto" when it has one: it only runs forward passes, whatever the scheme).
class EvaluatorTask {
 public:
  EvaluatorTask(const TrainOptions& o, const ClusterSpec& cluster, const EvaluatorOptions& eo)
      : o_(o),
        rank_(cluster.rank),
        job_(trainingDoneJob(cluster)),
        eo_(eo),
        dir_(o.checkpointDir),
        device_(resolveDevice(o.device, cluster.localRank)),
        data_(heldOutData(o)),
        model_(evaluationModel(o, data_, device_)),
        store_(dir_),
        done_(resumeRecord(dir_, rank_)),
        record_(evaluatorRecordPath(dir_, rank_), /*append=*/true) {
    if (!o.tensorboardDir.empty()) board_ = std::make_unique<TensorBoardWriter>(o.tensorboardDir + "/eval");
  }

  // Evaluates every checkpoint as it comes, until the chief's end-of-training marker says that
  // no other will; returns the exit status.
  int run() {
    for (;;) {
      // Read the marker before listing: a checkpoint listed after it was written is complete.
      const std::optional<int64_t> finalStep = readTrainingDone(dir_, job_);
      evaluateNewCheckpoints();
      if (finalStep) {
        if (!pendingUpTo(*finalStep)) return finish(*finalStep);
        continue;
      }
      COHORT_CHECK(secondsSince(lastProgress_) < eo_.idleTimeoutSeconds, TimeoutError, "evaluator ", rank_,
                   ": no new checkpoint in ", dir_, " for ", eo_.idleTimeoutSeconds,
                   " s and no end-of-training marker: is the chief running with this --checkpoint-dir? "
                   "(--evaluator-timeout sets the wait)");
      std::this_thread::sleep_for(std::chrono::duration<double>(eo_.pollSeconds));
    }
  }

 private:
  // The checkpoints in the directory that are not recorded yet, oldest first.
  void evaluateNewCheckpoints() {
    std::vector<CheckpointFile> files = store_.list();
    std::reverse(files.begin(), files.end());  // oldest first
    for (const CheckpointFile& file : files) {
      if (done_.count(file.step) != 0 || unreadable_.count(file.step) != 0) continue;
      if (std::optional<std::vector<uint8_t>> payload = readPayload(file)) evaluate(file, *payload);
    }
  }

  // The checkpoint's payload; nullopt for one pruned since it was listed, or one that does not
  // verify (reported once).
  std::optional<std::vector<uint8_t>> readPayload(const CheckpointFile& file) {
    try {
      return CheckpointStore::readVerified(file.path);
    } catch (const IoError& e) {
      if (!fs::exists(file.path)) return std::nullopt;  // pruned since it was listed
      std::fprintf(stderr, "cohort: warning: evaluator %d: %s; skipping it\n", rank_, e.what());
      unreadable_.insert(file.step);
      return std::nullopt;
    }
  }

  // Scores the checkpoint's model and records them: the eval event, TensorBoard, a line on stderr.
  void evaluate(const CheckpointFile& file, const std::vector<uint8_t>& payload) {
    loadCheckpointModel(payload, file.path, o_, device_, model_);
    const auto evalStart = Clock::now();
    auto forward = [&](const torch::Tensor& x) { return model_->forward(x); };
    const Scores test = scoreDataset(forward, data_.test, data_.classes, /*batch=*/1000, device_);
    MetricFields fields{{"step", file.step}};
    MetricFields scores = scoreFields("", test, false);
    fields.insert(fields.end(), scores.begin(), scores.end());
    std::optional<Scores> val;
    if (data_.validation.size() > 0) {
      val = scoreDataset(forward, data_.validation, data_.classes, /*batch=*/1000, device_);
      MetricFields v = scoreFields("val_", *val, false);
      fields.insert(fields.end(), v.begin(), v.end());
    }
    fields.emplace_back("eval_s", secondsSince(evalStart));
    fields.emplace_back("wall_s", secondsSince(start_));
    fields.emplace_back("checkpoint", file.path);
    fields.emplace_back("evaluator", int64_t(rank_));
    fields.emplace_back("device", device_.str());
    record_.write("eval", fields);
    if (board_) boardScores(file.step, test, val);
    std::fprintf(stderr, "cohort: evaluator %d: step %lld: test accuracy %.4f, loss %.4f\n", rank_,
                 (long long)file.step, test.accuracy, test.loss);
    done_.insert(file.step);
    ++evaluatedNow_;
    if (eo_.testKillAfter > 0 && int64_t(done_.size()) == eo_.testKillAfter) ::raise(SIGKILL);
    lastProgress_ = Clock::now();
  }

  void boardScores(int64_t step, const Scores& test, const std::optional<Scores>& val) {
    std::vector<std::pair<std::string, float>> scalars{{"test/accuracy", float(test.accuracy)},
                                                       {"test/loss", float(test.loss)},
                                                       {"test/macro_f1", float(test.macroF1)}};
    if (val) {
      scalars.emplace_back("validation/accuracy", float(val->accuracy));
      scalars.emplace_back("validation/loss", float(val->loss));
    }
    board_->scalars(step, scalars);
  }

  // Whether a checkpoint up to the final step is still on disk and neither recorded nor unreadable.
  bool pendingUpTo(int64_t finalStep) {
    for (const CheckpointFile& file : store_.list()) {
      if (file.step <= finalStep && done_.count(file.step) == 0 && unreadable_.count(file.step) == 0) return true;
    }
    return false;
  }

  // The record's done event, once every checkpoint of the run is recorded.
  int finish(int64_t finalStep) {
    record_.write("done", {{"final_step", finalStep},
                           {"evaluated", int64_t(done_.size())},
                           {"evaluated_by_this_process", evaluatedNow_},
                           {"wall_s", secondsSince(start_)}});
    std::fprintf(stderr, "cohort: evaluator %d: training ended at step %lld; %zu checkpoints evaluated\n", rank_,
                 (long long)finalStep, done_.size());
    return 0;
  }

  const TrainOptions& o_;
  const int rank_;
  const std::string job_;  // trainingDoneJob: the marker it takes for its own
  const EvaluatorOptions& eo_;
  const std::string dir_;
  const c10::Device device_;
  DataSplits data_;
  torch::nn::Sequential model_;
  CheckpointStore store_;
  std::set<int64_t> done_;  // the steps recorded, by this process or an earlier run of it
  MetricsWriter record_;
  std::unique_ptr<TensorBoardWriter> board_;
  const Clock::time_point start_ = Clock::now();
  Clock::time_point lastProgress_ = Clock::now();
  std::set<int64_t> unreadable_;  // reported once each
  int64_t evaluatedNow_ = 0;
};

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

std::string trainingDoneJob(const ClusterSpec& cluster) {
  const std::string key = cluster.storeKey();
  if (key.empty()) return "";
  const crypto::Digest digest = crypto::HmacSha256("cohort end-of-training marker").update(key).final();
  return crypto::toHex(std::span(digest).first(8));  // a digest's prefix, not the secret
}

void writeTrainingDone(const std::string& checkpointDir, int64_t step, const std::string& job) {
  nlohmann::json marker{{"step", step}};
  if (!job.empty()) marker["job"] = job;
  replaceFileWithText(trainingDoneMarkerPath(checkpointDir), marker.dump() + "\n");
}

std::optional<int64_t> readTrainingDone(const std::string& checkpointDir, const std::string& job) {
  const std::string path = trainingDoneMarkerPath(checkpointDir);
  if (!fs::exists(path)) return std::nullopt;
  const nlohmann::json marker = nlohmann::json::parse(readAll(path), nullptr, false);
  COHORT_CHECK(marker.is_object() && marker.contains("step") && marker["step"].is_number_integer(), IoError, path,
               ": not an end-of-training marker ({\"step\": N}): remove it");
  const std::string of = marker.contains("job") && marker["job"].is_string() ? marker["job"].get<std::string>() : "";
  if (!job.empty() && !of.empty() && of != job) return std::nullopt;  // an earlier run's
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
  // 0, a negative or NaN failed at the first look; inf never did.
  COHORT_CHECK(eo.idleTimeoutSeconds > 0 && eo.idleTimeoutSeconds <= 7 * 24 * 3600, InvalidArgument,
               "--evaluator-timeout must be a number of seconds in (0, 604800] (a week), got ", eo.idleTimeoutSeconds);
  const Scheme scheme = o.strategy.scheme;
  COHORT_CHECK(scheme != Scheme::kPipeline && scheme != Scheme::kPs && scheme != Scheme::kTensor, InvalidArgument,
               "an evaluator task reads whole-model checkpoints, which --strategy ", schemeName(scheme),
               " does not write (it checkpoints per ",
               scheme == Scheme::kPs         ? "shard"
               : scheme == Scheme::kPipeline ? "stage"
                                             : "way",
               "): drop the evaluator task");
  setComputeThreads(o.threads > 0 ? o.threads : ompNumThreadsFromEnvironment().value_or(1));
  torch::manual_seed(o.seed);
  return EvaluatorTask(o, cluster, eo).run();
}

}  // namespace cohort
