// The comparison's report: a self-contained HTML page (SVG charts inline, no script or font from
// anywhere else), the same charts as SVG and PNG files, and the raw data as CSV.
//
// Files under the output folder: report.html; figures/NAME.svg and figures/NAME.png (PNG through
// rsvg-convert); runs.csv (one row per run), evals.csv (one row per evaluation of every run),
// summary.csv (one row per configuration: medians, spread, the four rankings).
#pragma once

#include "experiment/plan.h"
#include "experiment/run_data.h"
#include "experiment/runner.h"

#include <optional>
#include <string>
#include <vector>

namespace cohort::experiment {

struct ConfigResult {
  Configuration config;
  std::vector<JobRecord> runs;  // run 1, 2, ...
  std::vector<RunData> data;    // the same order
  std::string command;          // run 1's command, shell-quoted (one line per process)
  int64_t epochExamples = 0;    // what one of its epochs trains on (less --validation); 0: the input's
};

struct ReportInput {
  std::string title;
  std::string invocation;  // the cohort compare command line
  std::string budget;      // "1 epoch", "300 steps", ...
  std::string network;     // "loopback" or the emulated rate
  int64_t trainExamples = 60000;  // one epoch's examples where a configuration gives none
  std::vector<ConfigResult> configs;
};

// One criterion of Skymind's four for one configuration: the median over its successful runs and
// the spread; nullopt when no run has a value.
struct Measure {
  std::optional<double> median;
  double low = 0, high = 0;
};

struct ConfigSummary {
  std::string name;
  int okRuns = 0;
  std::string error;  // the first failed run's error
  Measure samplesPerSecond, maxAccuracy, accuracyAtTime, accuracyAtEpochs, bytesPerStep, commWaitPerStep, wallSeconds;
};

struct Summary {
  double timeBudget = 0;    // the wall-clock time at which accuracyAtTime is read
  double epochBudget = 0;   // the epochs at which accuracyAtEpochs is read
  std::vector<ConfigSummary> configs;
};

Summary summarize(const ReportInput& input);

struct ReportOptions {
  bool png = true;  // figures/*.png through rsvg-convert (an error when it is missing)
};

// Writes everything into dir; returns report.html's path. Throws IoError when a file cannot be
// written or rsvg-convert fails.
std::string writeReport(const ReportInput& input, const std::string& dir, const ReportOptions& options = {});

// "host: 2 cores, AMD EPYC ..., 24 GiB, Linux 6.1" from /proc and uname.
std::string machineDescription();

// A CSV field, quoted when it holds a comma, a quote or a line break.
std::string csvField(const std::string& text);
// The shortest decimal text that reads back as v.
std::string exactNumber(double v);

}  // namespace cohort::experiment
