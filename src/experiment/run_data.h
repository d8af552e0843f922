// What one training run's JSON-lines metrics file says, read back for reports and leaderboards.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace cohort::experiment {

struct EvalPoint {
  int64_t step = 0;
  double epochs = 0;  // epoch_progress: steps / steps per epoch
  double accuracy = 0;
  double loss = 0;
  double wallSeconds = 0;
  std::optional<double> valAccuracy;  // when the run holds out a validation split
};

struct RunData {
  std::vector<EvalPoint> evals;
  bool hasDone = false;
  // From the done event (zero without one).
  int64_t steps = 0;
  double samplesPerSecond = 0;
  double testAccuracy = 0;
  std::optional<double> valAccuracy;
  double wallSeconds = 0;
  int64_t bytesSent = 0;
  int64_t bytesReceived = 0;
  double commWaitSeconds = 0;
  std::vector<int64_t> stalenessHistogram;  // asynchronous schemes: updates applied at each staleness

  double maxAccuracy() const;
  double bytesPerStep() const { return steps > 0 ? double(bytesSent + bytesReceived) / double(steps) : 0; }
  double commWaitPerStep() const { return steps > 0 ? commWaitSeconds / double(steps) : 0; }
  // The accuracy of the last evaluation at or before `seconds` / `epochs`; nullopt when none.
  std::optional<double> accuracyAtSeconds(double seconds) const;
  std::optional<double> accuracyAtEpochs(double epochs) const;
};

// Reads a metrics file; a missing file reads as an empty run. Throws IoError naming the file and
// line when a line is not JSON (a run killed mid-line leaves a last partial line: that one is
// skipped).
RunData readRunData(const std::string& path);

}  // namespace cohort::experiment
