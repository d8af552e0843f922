// `cohort sweep`: grid or random search over `cohort train` options, trials as separate jobs.
#include "cli/commands.h"
#include "cli/experiment_common.h"

#include "base/files.h"
#include "experiment/report.h"
#include "experiment/run_data.h"
#include "experiment/runner.h"
#include "experiment/sweep.h"

#include <cohort/error.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <memory>

namespace cohort::cli {

namespace {

struct SweepFlags {
  std::string file;
  int parallel = 1;
  int top = 0;
  std::string out = "sweep-out";
  double runTimeout = 3600;
  std::string device;  // every trial's, over the file's
};

std::string paramsText(const experiment::TrainArgs& args) {
  std::string out;
  for (const auto& [flag, value] : args) out += (out.empty() ? "" : " ") + flag.substr(2) + (value.empty() ? "" : "=" + value);
  return out;
}

// One job per trial: cohort train with the file's fixed options and the trial's chosen ones, under
// cohort launch when the trials have more than one process.
std::vector<experiment::JobSpec> trialJobs(const experiment::SweepSpace& space,
                                           const std::vector<experiment::Trial>& trials, const SweepFlags& f) {
  const std::string binary = selfExecutable();
  std::vector<experiment::JobSpec> jobs;
  for (const experiment::Trial& t : trials) {
    experiment::TrainArgs args = experiment::trialOptions(space, t);
    if (!f.device.empty()) experiment::setArg(args, "--device", f.device);
    experiment::setArg(args, "--metrics", experiment::metricsPathOf(f.out, t.id));
    experiment::setArg(args, "--progress", "off");
    if (f.top > 0) experiment::setArg(args, "--save-model", experiment::jobDirOf(f.out, t.id) + "/model.pt");
    std::vector<std::string> train{binary, "train"};
    for (const auto& [flag, value] : args) {
      train.push_back(flag);
      if (!value.empty()) train.push_back(value);
    }
    experiment::JobSpec job;
    job.id = t.id;
    job.threadsShare = space.workers;
    experiment::ProcessSpec process;
    process.argv = experiment::launchArgv(binary, space.workers, space.shards, std::move(train));
    job.processes.push_back(std::move(process));
    jobs.push_back(std::move(job));
  }
  return jobs;
}

// Every trial, --parallel at once, each reported as it ends.
std::vector<experiment::JobRecord> runTrials(const std::vector<experiment::JobSpec>& jobs, const SweepFlags& f) {
  experiment::RunnerOptions runner;
  runner.dir = f.out;
  runner.parallel = f.parallel;
  runner.timeoutSeconds = f.runTimeout;
  return experiment::runJobs(jobs, runner, [&](const experiment::JobRecord& r, size_t done, size_t total) {
    if (r.status == experiment::JobStatus::kOk) {
      const experiment::RunData d = experiment::readRunData(r.metricsPath);
      std::printf("[%zu/%zu] %s: ok%s, %.1f s, test accuracy %.4f\n", done, total, r.id.c_str(),
                  r.resumed ? " (finished earlier)" : "", r.wallSeconds, d.testAccuracy);
    } else {
      std::printf("[%zu/%zu] %s: FAILED%s: %s\n", done, total, r.id.c_str(), r.resumed ? " (earlier)" : "",
                  r.error.c_str());
    }
    std::fflush(stdout);
  });
}

// A trial on the leaderboard: its record's index, its data and its score (none when it failed).
struct Row {
  size_t index;
  experiment::RunData data;
  std::optional<double> score;
};

// The leaderboard: by validation accuracy when the trials report one, else by test accuracy; the
// trials without a score last. Sets `validation` to which one ranks them.
std::vector<Row> rankTrials(const std::vector<experiment::JobRecord>& records, bool& validation) {
  std::vector<Row> rows;
  validation = false;
  for (size_t i = 0; i < records.size(); ++i) {
    Row row{i, experiment::readRunData(records[i].metricsPath), std::nullopt};
    if (row.data.valAccuracy) validation = true;
    rows.push_back(std::move(row));
  }
  for (Row& row : rows) {
    if (records[row.index].status != experiment::JobStatus::kOk || !row.data.hasDone) continue;
    row.score = validation ? row.data.valAccuracy : std::optional<double>(row.data.testAccuracy);
  }
  std::stable_sort(rows.begin(), rows.end(), [](const Row& a, const Row& b) {
    if (a.score.has_value() != b.score.has_value()) return a.score.has_value();
    return a.score.value_or(0) > b.score.value_or(0);
  });
  return rows;
}

// A leaderboard row of results.jsonl.
nlohmann::ordered_json resultLine(const Row& row, int rank, const experiment::JobRecord& r, const experiment::Trial& t,
                                  const char* metric) {
  nlohmann::ordered_json j;
  j["trial"] = r.id;
  j["rank"] = rank;
  j["status"] = r.status == experiment::JobStatus::kOk ? "ok" : "failed";
  j["error"] = r.error;
  nlohmann::ordered_json params = nlohmann::ordered_json::object();
  for (const auto& [flag, value] : t.chosen) params[flag.substr(2)] = value.empty() ? "true" : value;
  j["options"] = params;
  j["ranked_by"] = metric;
  if (row.score) j["score"] = *row.score;
  if (row.data.valAccuracy) j["val_accuracy"] = *row.data.valAccuracy;
  j["test_accuracy"] = row.data.testAccuracy;
  j["samples_per_s"] = row.data.samplesPerSecond;
  j["wall_s"] = r.wallSeconds;
  j["metrics"] = r.metricsPath;
  j["command"] = r.command;
  return j;
}

// The leaderboard on stdout; returns it as results.jsonl's lines.
std::string printLeaderboard(const std::vector<Row>& rows, const std::vector<experiment::JobRecord>& records,
                             const std::vector<experiment::Trial>& trials, const char* metric) {
  std::string jsonl;
  std::printf("%-5s %-10s %-8s %-13s %-10s %-8s %s\n", "rank", "trial", "status", metric, "samples/s", "wall s",
              "options");
  int rank = 0;
  for (const Row& row : rows) {
    const experiment::JobRecord& r = records[row.index];
    const experiment::Trial& t = trials[row.index];
    if (row.score) ++rank;
    jsonl += resultLine(row, row.score ? rank : 0, r, t, metric).dump() + "\n";
    char score[32] = "-";
    if (row.score) std::snprintf(score, sizeof(score), "%.4f", *row.score);
    std::printf("%-5s %-10s %-8s %-13s %-10.0f %-8.1f %s%s\n", row.score ? std::to_string(rank).c_str() : "-",
                r.id.c_str(), r.status == experiment::JobStatus::kOk ? "ok" : "failed", score,
                row.data.samplesPerSecond, r.wallSeconds, paramsText(t.chosen).c_str(),
                r.status == experiment::JobStatus::kOk ? "" : ("  error: " + r.error).c_str());
  }
  return jsonl;
}

// OUT/results.jsonl, replaced whole.
void writeResults(const std::string& out, const std::string& jsonl) {
  const std::string path = out + "/results.jsonl";
  replaceFileWithText(path, jsonl);
  std::printf("results: %s\n", path.c_str());
}

// --top: the models of the best trials, copied to OUT/top/ as RANK-TRIAL.pt.
void keepTopModels(const std::vector<Row>& rows, const std::vector<experiment::JobRecord>& records,
                   const SweepFlags& f) {
  namespace fs = std::filesystem;
  fs::remove_all(f.out + "/top");  // an earlier resume's ranking
  fs::create_directories(f.out + "/top");
  int kept = 0;
  for (const Row& row : rows) {
    const std::string model = experiment::jobDirOf(f.out, records[row.index].id) + "/model.pt";
    if (!fs::exists(model)) continue;
    if (row.score && kept < f.top) {
      ++kept;
      const std::string to = f.out + "/top/" + std::to_string(kept) + "-" + records[row.index].id + ".pt";
      fs::copy_file(model, to, fs::copy_options::overwrite_existing);
      std::printf("top %d: %s\n", kept, to.c_str());
    }
  }
}

// The command once its line is parsed: the trials, their runs, the leaderboard.
int runSweep(const SweepFlags& f, const CLI::App& app) {
  COHORT_CHECK(f.parallel >= 1, InvalidArgument, "--parallel must be at least 1");
  COHORT_CHECK(f.top >= 0, InvalidArgument, "--top must not be negative");
  COHORT_CHECK(f.runTimeout > 0, InvalidArgument, "--run-timeout must be positive");
  const experiment::SweepSpace space = experiment::readSweepFile(f.file, trainCatalog(app));
  const std::vector<experiment::Trial> trials = experiment::expandTrials(space);
  COHORT_CHECK(!trials.empty(), InvalidArgument, f.file, ": no trials");
  const std::vector<experiment::JobSpec> jobs = trialJobs(space, trials, f);
  std::printf("cohort sweep: %zu trials (%s search), %d at once; output in %s\n", trials.size(),
              space.random ? "random" : "grid", f.parallel, f.out.c_str());
  std::fflush(stdout);
  const std::vector<experiment::JobRecord> records = runTrials(jobs, f);

  bool validation = false;
  const std::vector<Row> rows = rankTrials(records, validation);
  const char* metric = validation ? "val_accuracy" : "test_accuracy";
  if (!validation) {
    std::printf(
        "note: ranked by test accuracy: the trials report no val_accuracy (hold out a validation split "
        "with cohort train --validation N to select models on it)\n");
  }
  writeResults(f.out, printLeaderboard(rows, records, trials, metric));
  if (f.top > 0) keepTopModels(rows, records, f);
  const bool anyOk =
      std::any_of(records.begin(), records.end(), [](const auto& r) { return r.status == experiment::JobStatus::kOk; });
  COHORT_CHECK(anyOk, Error, "every trial failed; the first: ", records.front().id, ": ", records.front().error);
  return 0;
}

}  // namespace

Run addSweepCommand(CLI::App& app) {
  auto flags = std::make_shared<SweepFlags>();
  SweepFlags& f = *flags;
  CLI::App* cmd = app.add_subcommand("sweep", "Grid or random search over cohort train's options, trials in parallel");
  cmd->footer(
      "FILE.toml: any cohort train option as a value, a list [a, b] or a range {min, max, log, steps};\n"
      "[sweep] mode = \"grid\" | \"random\", trials, seed, workers, ps. Finished trials are kept in OUT/runs:\n"
      "run the same command again after a kill to go on. Results: OUT/results.jsonl and a leaderboard\n"
      "ranked by val_accuracy (when the trials report one) or else test accuracy.");
  cmd->option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  cmd->add_option("file", f.file, "The search space (TOML)")->required();
  cmd->add_option("--parallel", f.parallel, "Trials at once (the cores are split among them)")->capture_default_str();
  cmd->add_option("--top", f.top, "Keep the models of the best N trials in OUT/top/ (--save-model)")
      ->capture_default_str();
  cmd->add_option("--out", f.out, "Output folder (results.jsonl, runs/, top/)")->capture_default_str();
  cmd->add_option("--device", f.device, "cpu, cuda or cuda:N for every trial (over the file's device)");
  cmd->add_option("--run-timeout", f.runTimeout, "Seconds after which a trial is stopped and counted as failed")
      ->capture_default_str();
  return [flags, &app]() { return runSweep(*flags, app); };
}

}  // namespace cohort::cli
