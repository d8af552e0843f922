// `cohort compare`: the seeds' question "which approach is best?" answered on the user's model.
#include "cli/commands.h"
#include "cli/experiment_common.h"

#include "base/files.h"
#include "base/subprocess.h"
#include "experiment/netns.h"
#include "experiment/remote.h"
#include "experiment/report.h"
#include "experiment/run_data.h"
#include "experiment/runner.h"

#include <cohort/error.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <optional>
#include <set>

namespace cohort::cli {

namespace {

struct CompareFlags {
  std::string file;
  std::string model = "cnn";
  std::string data = "fashion-mnist";
  uint64_t seed = 1;
  int64_t batch = 64;
  std::string lr;
  std::string device;
  std::string autocast;  // --autocast for every run; empty: train's (off)
  int64_t epochs = 1;
  // Given or not (0 is a budget, and refused, not "not given").
  std::optional<int64_t> steps;
  std::optional<int64_t> examples;
  std::optional<double> seconds;
  int workers = 2;
  std::string codec = "none";
  std::string only;
  int runs = 1;
  int evaluations = 10;
  std::string out = "compare-out";
  std::string network;
  double runTimeout = 3600;
  bool noPng = false;
  std::string hosts;
  std::string hostfile;
  std::string remoteShell = experiment::RemoteHosts{}.shell;
  std::string remoteBinary;
  int basePort = experiment::kDefaultBasePort;
};

// Variables of compare's own environment that every remote process gets too.
constexpr const char* kPassedToHosts[] = {"GLOO_SOCKET_IFNAME", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS",
                                          "COHORT_FASHION_MNIST_DIR", "COHORT_CODEC_PATH"};

// --hosts / --hostfile and their options, checked; nullopt without hosts.
std::optional<experiment::RemoteHosts> remoteHostsFrom(const CompareFlags& f, const CLI::App& cmd,
                                                       const std::string& binary) {
  const bool given = !f.hosts.empty() || !f.hostfile.empty();
  for (const char* option : {"--remote-shell", "--remote-binary", "--base-port"}) {
    COHORT_CHECK(given || cmd.count(option) == 0, InvalidArgument, option, " goes with --hosts or --hostfile");
  }
  if (!given) return std::nullopt;
  COHORT_CHECK(f.hosts.empty() || f.hostfile.empty(), InvalidArgument, "give --hosts or --hostfile, not both");
  COHORT_CHECK(f.network.empty(), InvalidArgument,
               "--network emulates links on this machine; it does not go with --hosts or --hostfile");
  experiment::RemoteHosts h;
  if (!f.hosts.empty()) {
    h.hosts = experiment::parseHostList(f.hosts, ',', "--hosts");
  } else {
    h.hosts = experiment::parseHostList(readNamedFile("--hostfile", f.hostfile), '\n', "--hostfile " + f.hostfile);
  }
  experiment::splitShellWords(f.remoteShell);  // its errors now, before anything runs
  h.shell = f.remoteShell;
  h.binary = f.remoteBinary.empty() ? binary : f.remoteBinary;
  h.workdir = std::filesystem::current_path().string();
  COHORT_CHECK(f.basePort >= 1 && f.basePort <= 65535, InvalidArgument, "--base-port ", f.basePort,
               ": expected a port, 1 to 65535");
  h.basePort = f.basePort;
  for (const char* name : kPassedToHosts) {
    if (const char* value = std::getenv(name); value != nullptr) h.env[name] = value;
  }
  return h;
}

std::vector<std::string> splitComma(const std::string& text) {
  std::vector<std::string> out;
  std::string item;
  for (char c : text + ",") {
    if (c == ',') {
      if (!item.empty()) out.push_back(item);
      item.clear();
    } else {
      item += c;
    }
  }
  return out;
}

// What the model's check trains on: a few synthetic examples of the runs' kind (images, or bags of
// ids below the same ROWS), or a libsvm run's own file (whose ids the model's table must hold).
std::string checkData(const std::string& data) {
  if (data.rfind("libsvm:", 0) == 0) return data;
  if (data == "synthetic-bags" || data.rfind("synthetic-bags:", 0) == 0) {
    const size_t comma = data.find(',');
    return "synthetic-bags:60" + (comma == std::string::npos ? std::string() : data.substr(comma));
  }
  return "synthetic:60";
}

// A train run of one step on a few examples: the model must at least build and train, on the
// runs' device when one is given, before a comparison of many runs starts on it.
void checkModel(const std::string& binary, const std::string& model, const std::string& data,
                const std::string* device) {
  std::vector<std::string> argv{binary, "train",   "--model", model,       "--data", checkData(data), "--steps",
                                "1",    "--batch", "4",       "--threads", "1",      "--progress",    "off"};
  if (device != nullptr) argv.insert(argv.end(), {"--device", *device});
  // Bounded, in a group of its own that goes with it (a wedged device, a model file on a hung
  // mount): popen waited for it without end.
  constexpr auto kLimit = std::chrono::seconds(300);
  CapturedRun run;
  try {
    run = runCapturingOutput(argv, kLimit, 1 << 20);
  } catch (const SubprocessError& e) {
    throw Error("cannot check --model " + model + ": " + e.what());
  }
  COHORT_CHECK(run.status.has_value(), TimeoutError, "--model ", model, ": its one-step check (", binary,
               " train ... --steps 1) did not end within ", kLimit.count(), " s");
  const std::string& output = run.output;
  if (!run.status->ok()) {
    std::string why = experiment::errorFromLog(output);
    if (device != nullptr)
      throw InvalidArgument("--model " + model + " cannot be trained on --device " + *device + ": " + why);
    throw InvalidArgument("--model " + model + " cannot be trained by any scheme: " + why);
  }
}

std::string budgetText(const experiment::Budget& b) {
  if (b.steps > 0) return std::to_string(b.steps) + " steps per process";
  if (b.examples > 0) return std::to_string(b.examples) + " training examples";
  if (b.seconds > 0) {
    char text[64];
    std::snprintf(text, sizeof(text), "%g s of training", b.seconds);
    return text;
  }
  return std::to_string(b.epochs) + (b.epochs == 1 ? " epoch" : " epochs");
}

// What runs: the positional file of configurations, and the train options every run shares.
void addTrainOptions(CLI::App* cmd, CompareFlags& f) {
  cmd->add_option("file", f.file, "A TOML file listing the configurations (default: the seeds' set)");
  cmd->add_option("--model", f.model,
                  "The model of every run, as cohort train --model: mlp, mlp:WIDTH, cnn, lstm, embed[:...] (with "
                  "bags of ids) or FILE.pt")
      ->capture_default_str();
  cmd->add_option("--data", f.data,
                  "fashion-mnist, mnist:DIR, synthetic[:N], libsvm:TRAIN[,TEST] or synthetic-bags[:N[,ROWS]] "
                  "(bags with --model embed)")
      ->capture_default_str();
  cmd->add_option("--seed", f.seed, "The same seed for every run")->capture_default_str();
  cmd->add_option("--batch", f.batch, "Batch size per worker")->capture_default_str();
  cmd->add_option("--lr", f.lr, "Learning rate (default: train's)");
  cmd->add_option("--device", f.device,
                  "cpu, cuda or cuda:N for every run without a device of its own in FILE (default: train's, each "
                  "rank's GPU when there is one)");
  cmd->add_option("--autocast", f.autocast,
                  "off or bf16 for every run without one of its own in FILE (cohort train --autocast; default: off)")
      ->check(CLI::IsMember({"off", "bf16"}));
}

// How long every run trains: one of epochs, steps, examples or seconds.
void addBudgetOptions(CLI::App* cmd, CompareFlags& f) {
  cmd->add_option("--epochs", f.epochs, "Budget: epochs of every run")->capture_default_str();
  cmd->add_option("--steps", f.steps, "Budget: steps of every process (instead of --epochs)");
  cmd->add_option("--examples", f.examples, "Budget: training examples of every run, all workers together");
  cmd->add_option("--seconds", f.seconds,
                  "Budget: wall-clock seconds of every run (it stops at the first evaluation after them)");
}

// Which configurations run, how many times each, and how often they evaluate.
void addConfigurationOptions(CLI::App* cmd, CompareFlags& f) {
  cmd->add_option("--workers", f.workers, "Processes of every distributed scheme")->capture_default_str();
  cmd->add_option("--codec", f.codec, "Also run the compressing schemes with this codec (fp16, topk:0.01, ...)")
      ->capture_default_str();
  cmd->add_option("--only", f.only, "Run only these configurations of the default set (NAME,NAME,...)");
  cmd->add_option("--runs", f.runs, "Runs of every configuration (medians and spread are reported)")
      ->capture_default_str();
  cmd->add_option("--evaluations", f.evaluations,
                  "Test-set evaluations per run (the accuracy curves' points; per epoch with --seconds)")
      ->capture_default_str();
}

// Where the report goes, and the links, time limit and figures of the runs.
void addOutputOptions(CLI::App* cmd, CompareFlags& f) {
  cmd->add_option("--out", f.out, "Output folder (report.html, figures/, *.csv, runs/)")->capture_default_str();
  cmd->add_option(
      "--network", f.network,
      "Run every process in a network namespace joined by links of this rate (tc tbf; root): 100mbit, 1gbit");
  cmd->add_option("--run-timeout", f.runTimeout, "Seconds after which a run is stopped and counted as failed")
      ->capture_default_str();
  cmd->add_flag("--no-png", f.noPng, "Do not render the figures as PNG (rsvg-convert)");
}

// Runs on other machines: the hosts and how a process starts there.
void addHostOptions(CLI::App* cmd, CompareFlags& f) {
  cmd->add_option("--hosts", f.hosts,
                  "Run every process on these machines (H1,H2,...; user@H logs in as user): process i of a run on "
                  "host i mod n, ranks first, then the ps shards. OUT and this folder must be on a filesystem the "
                  "hosts share");
  cmd->add_option("--hostfile", f.hostfile, "The hosts from a file, one a line (# comments), instead of --hosts");
  cmd->add_option("--remote-shell", f.remoteShell,
                  "How a process starts on a host ({host} is replaced; stdin must be passed on, so no ssh -n)")
      ->capture_default_str();
  cmd->add_option("--remote-binary", f.remoteBinary, "cohort's path on the hosts (default: this one's)");
  cmd->add_option("--base-port", f.basePort,
                  "Process i of a run listens on this port + i on its host (rank 0's rendezvous, the ps shards)")
      ->capture_default_str();
}

// The budget the flags give, checked: one of them, positive.
experiment::Budget budgetOf(const CompareFlags& f) {
  experiment::Budget budget;
  const int budgets = int(f.steps.has_value()) + int(f.examples.has_value()) + int(f.seconds.has_value());
  COHORT_CHECK(budgets <= 1, InvalidArgument, "give one budget: --epochs, --steps, --examples or --seconds");
  if (f.seconds) {
    COHORT_CHECK(*f.seconds > 0, InvalidArgument, "--seconds must be positive (the budget of every run)");
    budget.seconds = *f.seconds;
  } else if (f.steps) {
    COHORT_CHECK(*f.steps > 0, InvalidArgument, "--steps must be positive (the budget of every run)");
    budget.steps = *f.steps;
  } else if (f.examples) {
    COHORT_CHECK(*f.examples > 0, InvalidArgument, "--examples must be positive (the budget of every run)");
    budget.examples = *f.examples;
  } else {
    COHORT_CHECK(f.epochs > 0, InvalidArgument, "--epochs must be positive (the budget of every run)");
    budget.epochs = f.epochs;
  }
  return budget;
}

void checkCounts(const CompareFlags& f) {
  COHORT_CHECK(f.runs >= 1, InvalidArgument, "--runs must be at least 1");
  COHORT_CHECK(f.workers >= 1, InvalidArgument, "--workers must be at least 1");
  COHORT_CHECK(f.batch >= 1, InvalidArgument, "--batch must be positive");
  COHORT_CHECK(f.evaluations >= 1, InvalidArgument, "--evaluations must be at least 1");
  COHORT_CHECK(f.runTimeout > 0, InvalidArgument, "--run-timeout must be positive");
}

// --only's configurations of the default set, in --only's order.
std::vector<experiment::Configuration> pick(const std::vector<experiment::Configuration>& configs,
                                            const std::string& only) {
  std::vector<experiment::Configuration> picked;
  for (const std::string& name : splitComma(only)) {
    auto it = std::find_if(configs.begin(), configs.end(), [&](const auto& c) { return c.name == name; });
    std::string known;
    for (const auto& c : configs) known += (known.empty() ? "" : ", ") + c.name;
    COHORT_CHECK(it != configs.end(), InvalidArgument, "--only: no configuration '", name, "' (", known, ")");
    picked.push_back(*it);
  }
  return picked;
}

// The configurations to run: FILE's (its shared train options into `fileShared`), else the seeds'
// set, or --only's part of it.
std::vector<experiment::Configuration> configurationsOf(const CompareFlags& f, const experiment::OptionCatalog& catalog,
                                                        experiment::TrainArgs& fileShared) {
  if (!f.file.empty()) {
    experiment::CompareFile file = experiment::readCompareFile(f.file, catalog);
    fileShared = std::move(file.shared);
    COHORT_CHECK(f.only.empty(), InvalidArgument, "--only picks from the default set; edit ", f.file, " instead");
    return std::move(file.configurations);
  }
  std::vector<experiment::Configuration> configs = experiment::defaultConfigurations(f.workers, f.codec);
  return f.only.empty() ? configs : pick(configs, f.only);
}

// The command line's options, then the file's shared ones (which win where both are given only if
// the command line left them at their defaults).
experiment::TrainArgs sharedTrainArgs(const CompareFlags& f, const CLI::App& cmd,
                                      const experiment::TrainArgs& fileShared) {
  experiment::TrainArgs shared;
  auto cliOption = [&](const char* flag, const std::string& value) {
    if (cmd.count(flag) > 0 || experiment::findArg(fileShared, flag) == nullptr) {
      experiment::setArg(shared, flag, value);
    }
  };
  cliOption("--model", f.model);
  cliOption("--data", f.data);
  cliOption("--seed", std::to_string(f.seed));
  cliOption("--batch", std::to_string(f.batch));
  if (!f.lr.empty()) experiment::setArg(shared, "--lr", f.lr);
  if (!f.device.empty()) experiment::setArg(shared, "--device", f.device);
  if (!f.autocast.empty()) experiment::setArg(shared, "--autocast", f.autocast);
  for (const auto& [flag, value] : fileShared) {
    if (experiment::findArg(shared, flag) == nullptr) experiment::setArg(shared, flag, value);
  }
  return shared;
}

// The most processes one run has (workers and shards): the ports and namespaces it needs.
int processesPerRun(const std::vector<experiment::Configuration>& configs) {
  int processes = 1;
  for (const auto& c : configs) processes = std::max(processes, c.workers + c.shards);
  return processes;
}

// OUT made and every host checked before anything runs; a check that fails leaves no OUT behind.
void checkHostsSeeOut(const experiment::RemoteHosts& hosts, const std::string& out,
                      const experiment::HostTraining& training) {
  std::error_code ec;
  const bool created = std::filesystem::create_directories(out, ec);
  COHORT_CHECK(!ec, IoError, out, ": cannot create the output folder: ", ec.message());
  try {
    // A training step starts LibTorch (and CUDA) on the host: longer than a shell's answer.
    experiment::checkHosts(hosts, out, training,
                           training.device.empty() ? experiment::kHostCheckSeconds : 4 * experiment::kHostCheckSeconds);
  } catch (const InvalidArgument&) {
    if (created) std::filesystem::remove(out, ec);  // nothing ran: leave nothing behind
    throw;
  }
}

// Every run, one at a time (they are timed), each reported as it ends.
std::vector<experiment::JobRecord> runAll(const std::vector<experiment::JobSpec>& jobs, const CompareFlags& f) {
  experiment::RunnerOptions runner;
  runner.dir = f.out;
  runner.parallel = 1;  // runs are timed: one at a time
  runner.timeoutSeconds = f.runTimeout;
  return experiment::runJobs(jobs, runner, [](const experiment::JobRecord& r, size_t done, size_t total) {
    if (r.status == experiment::JobStatus::kOk) {
      const experiment::RunData d = experiment::readRunData(r.metricsPath);
      std::printf("[%zu/%zu] %s: ok%s, %.1f s, test accuracy %.4f, %.0f samples/s\n", done, total, r.id.c_str(),
                  r.resumed ? " (finished earlier)" : "", r.wallSeconds, d.testAccuracy, d.samplesPerSecond);
    } else {
      std::printf("[%zu/%zu] %s: FAILED%s: %s\n", done, total, r.id.c_str(), r.resumed ? " (earlier)" : "",
                  r.error.c_str());
    }
    std::fflush(stdout);
  });
}

// How the runs' processes were connected, for the report.
std::string networkText(const CompareFlags& f, const std::optional<experiment::RemoteHosts>& hosts) {
  if (hosts) {
    std::string list;
    for (const std::string& h : hosts->hosts) list += (list.empty() ? "" : ", ") + h;
    return "hosts " + list + " (process i on host i mod " + std::to_string(hosts->hosts.size()) +
           ", ps shards after the ranks), through " + hosts->shell;
  }
  return f.network.empty() ? "loopback (one machine)"
                           : "emulated: every process in its own network namespace, links of " + f.network;
}

// Each configuration with its runs' records and data (run r of configuration i is record
// r * configurations + i).
std::vector<experiment::ConfigResult> configResults(const std::vector<experiment::Configuration>& configs, int runs,
                                                    const std::vector<experiment::JobRecord>& records,
                                                    const experiment::PlanOptions& plan) {
  std::vector<experiment::ConfigResult> results;
  for (size_t i = 0; i < configs.size(); ++i) {
    experiment::ConfigResult c;
    c.config = configs[i];
    c.epochExamples = experiment::epochExamples(configs[i], plan);
    for (int r = 0; r < runs; ++r) {
      const experiment::JobRecord& rec = records[size_t(r) * configs.size() + i];
      c.runs.push_back(rec);
      c.data.push_back(experiment::readRunData(rec.metricsPath));
    }
    c.command = records[i].command;  // run 1's, exactly as it ran
    results.push_back(std::move(c));
  }
  return results;
}

// The configurations that did best on each criterion, by their medians.
void printWinners(const experiment::Summary& summary) {
  auto best = [&](experiment::Measure experiment::ConfigSummary::*field, const char* what, const char* format) {
    const experiment::ConfigSummary* top = nullptr;
    for (const auto& c : summary.configs) {
      if ((c.*field).median && (top == nullptr || *(c.*field).median > *(top->*field).median)) top = &c;
    }
    if (top != nullptr) {
      std::printf("%s: %s (", what, top->name.c_str());
      std::printf(format, *(top->*field).median);
      std::printf(")\n");
    }
  };
  best(&experiment::ConfigSummary::samplesPerSecond, "fastest training", "%.0f samples/s");
  best(&experiment::ConfigSummary::maxAccuracy, "highest accuracy", "%.4f");
  char atTime[64];  // to a tenth of a second, as the report: short runs read "after 0 s" in whole ones
  std::snprintf(atTime, sizeof(atTime), "best accuracy after %.1f s", summary.timeBudget);
  best(&experiment::ConfigSummary::accuracyAtTime, atTime, "%.4f");
  char atEpochs[64];
  std::snprintf(atEpochs, sizeof(atEpochs), "best accuracy after %.2f epochs", summary.epochBudget);
  best(&experiment::ConfigSummary::accuracyAtEpochs, atEpochs, "%.4f");
}

// The command once its line is parsed: the plan, the runs, the report.
int runCompare(const CompareFlags& f, const CLI::App& app) {
  const experiment::OptionCatalog catalog = trainCatalog(app);
  const experiment::Budget budget = budgetOf(f);
  checkCounts(f);
  experiment::PlanOptions plan;
  plan.binary = selfExecutable();
  plan.dir = f.out;
  plan.budget = budget;
  plan.runs = f.runs;
  plan.evaluations = f.evaluations;
  experiment::TrainArgs fileShared;
  const std::vector<experiment::Configuration> configs = configurationsOf(f, catalog, fileShared);
  const CLI::App* cmd = app.get_subcommand("compare");
  plan.shared = sharedTrainArgs(f, *cmd, fileShared);
  const std::string model = *experiment::findArg(plan.shared, "--model");
  const std::string data = *experiment::findArg(plan.shared, "--data");
  plan.trainExamples = experiment::trainingExamples(data);

  const std::optional<experiment::RemoteHosts> hosts = remoteHostsFrom(f, *cmd, plan.binary);
  if (hosts) {
    const int processes = processesPerRun(configs);
    COHORT_CHECK(hosts->basePort + processes - 1 <= 65535, InvalidArgument, "--base-port ", hosts->basePort, ": ",
                 processes, " processes need ports up to ", hosts->basePort + processes - 1);
    plan.hosts = &*hosts;
  }
  std::unique_ptr<experiment::EmulatedNetwork> network;
  if (!f.network.empty()) {
    network = std::make_unique<experiment::EmulatedNetwork>(f.network, processesPerRun(configs));
    plan.network = network.get();
  }
  // With --hosts the runs' device is on the hosts, not here: the check trains on this one's default,
  // and each host trains one step on --device.
  const std::string* device = experiment::findArg(plan.shared, "--device");
  checkModel(plan.binary, model, data, hosts ? nullptr : device);
  if (hosts) checkHostsSeeOut(*hosts, f.out, {.model = model, .device = device != nullptr ? *device : ""});

  const std::vector<experiment::JobSpec> jobs = experiment::planJobs(configs, plan);
  std::printf("cohort compare: %zu configurations x %d run%s = %zu runs of %s on %s, %s; output in %s\n",
              configs.size(), f.runs, f.runs == 1 ? "" : "s", jobs.size(), model.c_str(), data.c_str(),
              budgetText(budget).c_str(), f.out.c_str());
  std::fflush(stdout);
  const std::vector<experiment::JobRecord> records = runAll(jobs, f);

  experiment::ReportInput input;
  input.title = "cohort compare: " + model + " on " + data + ", " + budgetText(budget);
  input.invocation = selfInvocation();
  input.budget = budgetText(budget) + ", seed " + std::to_string(f.seed) + ", " + std::to_string(f.runs) +
                 (f.runs == 1 ? " run" : " runs") + " per configuration";
  input.network = networkText(f, hosts);
  input.trainExamples = plan.trainExamples;
  input.configs = configResults(configs, f.runs, records, plan);
  experiment::ReportOptions reportOptions;
  reportOptions.png = !f.noPng;
  const std::string report = experiment::writeReport(input, f.out, reportOptions);
  printWinners(experiment::summarize(input));
  const size_t ok = size_t(std::count_if(records.begin(), records.end(), [](const experiment::JobRecord& r) {
    return r.status == experiment::JobStatus::kOk;
  }));
  std::printf("report: %s (%zu of %zu runs ok)\n", report.c_str(), ok, records.size());
  COHORT_CHECK(ok > 0, Error, "every run failed; the first: ", records.front().id, ": ", records.front().error);
  return 0;
}

}  // namespace

Run addCompareCommand(CLI::App& app) {
  auto flags = std::make_shared<CompareFlags>();
  CLI::App* cmd =
      app.add_subcommand("compare", "Run several schemes on the same model, data and budget; write a report");
  cmd->footer(
      "Without FILE.toml the seeds' set runs: local, allreduce, average (K=4, 16), ps sync, sync with a backup\n"
      "worker, async, softsync, ssp, gossip and pipeline (with --codec C, the compressing ones again with C).\n"
      "FILE.toml: train options for all at the top level, then [[configuration]] tables with name, strategy,\n"
      "workers, ps and train options. Finished runs are kept in OUT/runs: run the same command again to go on.\n"
      "OUT/report.html is the report (OUT/figures/*.svg|png, OUT/*.csv the data).\n"
      "--hosts H1,H2: every process runs on a host through --remote-shell, in this working folder, with the\n"
      "variables cohort launch would set on its command line (the auth token on its stdin); process i of a run\n"
      "(ranks, then ps shards) on host i mod n, port --base-port + i. Each host must answer, see OUT and this\n"
      "folder as this machine does (a shared filesystem: the runs write their metrics there), have\n"
      "--remote-binary and, with --device, train a step on it, or nothing runs. A run that ends (timeout,\n"
      "Ctrl-C) closes the remote shell's stdin, and its remote process gets SIGTERM.");
  cmd->option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  addTrainOptions(cmd, *flags);
  addBudgetOptions(cmd, *flags);
  addConfigurationOptions(cmd, *flags);
  addOutputOptions(cmd, *flags);
  addHostOptions(cmd, *flags);
  return [flags, &app]() { return runCompare(*flags, app); };
}

}  // namespace cohort::cli
