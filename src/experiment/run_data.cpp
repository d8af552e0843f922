#include "experiment/run_data.h"

#include <cohort/error.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <fstream>

namespace cohort::experiment {

namespace {

double number(const nlohmann::json& j, const char* key) {
  auto it = j.find(key);
  return it != j.end() && it->is_number() ? it->get<double>() : 0.0;
}

std::optional<double> optionalNumber(const nlohmann::json& j, const char* key) {
  auto it = j.find(key);
  if (it != j.end() && it->is_number()) return it->get<double>();
  return std::nullopt;
}

}  // namespace

double RunData::maxAccuracy() const {
  double best = evals.empty() ? testAccuracy : 0.0;
  for (const EvalPoint& e : evals) best = std::max(best, e.accuracy);
  return best;
}

std::optional<double> RunData::accuracyAtSeconds(double seconds) const {
  std::optional<double> found;
  for (const EvalPoint& e : evals) {
    if (e.wallSeconds <= seconds + 1e-9) found = e.accuracy;
  }
  return found;
}

std::optional<double> RunData::accuracyAtEpochs(double epochs) const {
  std::optional<double> found;
  for (const EvalPoint& e : evals) {
    if (e.epochs <= epochs + 1e-9) found = e.accuracy;
  }
  return found;
}

RunData readRunData(const std::string& path) {
  RunData run;
  std::ifstream in(path);
  if (!in) return run;
  std::string line;
  int number_ = 0;
  while (std::getline(in, line)) {
    ++number_;
    if (line.empty()) continue;
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(line);
    } catch (const nlohmann::json::exception&) {
      if (in.peek() == std::char_traits<char>::eof()) break;  // a last line cut by a kill
      throw IoError(path + ":" + std::to_string(number_) + ": not a JSON line");
    }
    const std::string event = j.value("event", "");
    if (event == "eval") {
      EvalPoint e;
      e.step = int64_t(number(j, "step"));
      e.epochs = number(j, "epoch_progress");
      e.accuracy = number(j, "accuracy");
      e.loss = number(j, "loss");
      e.wallSeconds = number(j, "wall_s");
      e.valAccuracy = optionalNumber(j, "val_accuracy");
      run.evals.push_back(e);
    } else if (event == "done") {
      run.hasDone = true;
      run.steps = int64_t(number(j, "steps"));
      run.samplesPerSecond = number(j, "samples_per_s");
      run.testAccuracy = number(j, "test_accuracy");
      run.valAccuracy = optionalNumber(j, "val_accuracy");
      run.wallSeconds = number(j, "wall_s");
      run.bytesSent = int64_t(number(j, "bytes_sent"));
      run.bytesReceived = int64_t(number(j, "bytes_received"));
      run.commWaitSeconds = number(j, "comm_wait_s");
      auto h = j.find("staleness_histogram");
      if (h != j.end() && h->is_array()) run.stalenessHistogram = h->get<std::vector<int64_t>>();
    }
  }
  return run;
}

}  // namespace cohort::experiment
