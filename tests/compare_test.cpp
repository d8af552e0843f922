// `cohort compare` and `cohort sweep` end to end, on tiny synthetic runs: the report opened by a
// real headless Chromium with the network off, the CSV against the runs' JSON lines, a failing
// configuration reported while the others run, a killed comparison or sweep resumed without
// rerunning what finished.
#include "process_list.h"
#include "test_util.h"

#include <poll.h>
#include <sys/syscall.h>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <map>
#include <regex>
#include <thread>

namespace cohort {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

// A comparison file: two ranks everywhere, a parameter server with a staleness histogram, and a
// pipeline whose cut cannot be made (the partition names more layers than the mlp has).
constexpr const char* kCompareFile = R"(model = "mlp"
data = "synthetic:600"
batch = 16
threads = 1
timeout = 60

[[configuration]]
name = "local"
strategy = "local"

[[configuration]]
name = "allreduce"
strategy = "allreduce"
workers = 2

[[configuration]]
name = "ps-async"
strategy = "ps"
workers = 2
ps = 1
ps_mode = "async"

[[configuration]]
name = "pipeline-uncut"
strategy = "pipeline"
workers = 2
stages = 2
partition = "5,5"
)";

std::vector<std::vector<std::string>> readCsv(const std::string& path) {
  std::vector<std::vector<std::string>> rows;
  for (const std::string& line : test::lines(test::readFile(path))) {
    std::vector<std::string> cells;
    std::string cell;
    bool quoted = false;
    for (size_t i = 0; i < line.size(); ++i) {
      const char c = line[i];
      if (quoted) {
        if (c == '"' && i + 1 < line.size() && line[i + 1] == '"') {
          cell += '"';
          ++i;
        } else if (c == '"') {
          quoted = false;
        } else {
          cell += c;
        }
      } else if (c == '"') {
        quoted = true;
      } else if (c == ',') {
        cells.push_back(cell);
        cell.clear();
      } else {
        cell += c;
      }
    }
    cells.push_back(cell);
    rows.push_back(cells);
  }
  return rows;
}

std::map<std::string, size_t> header(const std::vector<std::string>& row) {
  std::map<std::string, size_t> out;
  for (size_t i = 0; i < row.size(); ++i) out[row[i]] = i;
  return out;
}

using test::events;

std::string compareCommand(const std::string& file, const std::string& out) {
  return test::cohortBinary() + " compare " + file + " --steps 12 --evaluations 3 --out " + out;
}

// Headless Chromium as the report's reader: no network (a dead proxy and no name resolution),
// an empty profile. Returns what it printed (stderr with the console log) and the dumped DOM.
struct Browser {
  std::string log;
  std::string dom;
};

Browser openInChromium(const std::string& html, const std::string& screenshot, const test::TempDir& dir) {
  const std::string flags =
      "chromium --headless --no-sandbox --disable-gpu --no-first-run --disable-background-networking "
      "--disable-component-update --disable-sync --user-data-dir=" + dir.file("profile") +
      " --proxy-server=127.0.0.1:9 --host-resolver-rules='MAP * ~NOTFOUND' --enable-logging=stderr --v=0 ";
  Browser b;
  auto shot = test::runCommand(flags + "--window-size=1280,6000 --screenshot=" + screenshot + " file://" + html, 120);
  EXPECT_EQ(shot.exitCode, 0) << shot.output;
  b.log = shot.output;
  auto dom = test::runCommand(flags + "--dump-dom file://" + html + " 2>/dev/null", 120);
  EXPECT_EQ(dom.exitCode, 0) << dom.output;
  b.dom = dom.output;
  return b;
}

TEST(Compare, ReportOpensInChromiumAndTheCsvMatchesTheRuns) {
  test::TempDir dir;
  test::writeFile(dir.file("c.toml"), kCompareFile);
  const std::string out = dir.file("out");
  auto r = test::runCommand(compareCommand(dir.file("c.toml"), out), 600);
  ASSERT_EQ(r.exitCode, 0) << r.output;
  EXPECT_NE(r.output.find("pipeline-uncut.r1: FAILED"), std::string::npos) << r.output;

  // Every chart, with one series per configuration that ran (the failed pipeline has none), and
  // the staleness chart with the one asynchronous scheme.
  const Browser b = openInChromium(out + "/report.html", dir.file("shot.png"), dir);
  EXPECT_NE(b.dom.find("charts=6;accuracy-epochs=3;accuracy-time=3;samples-per-second=3;bytes-per-step=3;"
                       "communication-wait=3;staleness=1"),
            std::string::npos)
      << b.dom.substr(0, 2000);
  // The console said only what the page's own check logs: no script error, no failed load.
  size_t consoleLines = 0;
  for (const std::string& line : test::lines(b.log)) {
    if (line.find("CONSOLE") == std::string::npos) continue;
    ++consoleLines;
    EXPECT_NE(line.find("cohort-report: charts=6"), std::string::npos) << line;
  }
  EXPECT_EQ(consoleLines, 1u) << b.log;
  const std::string png = test::readFile(dir.file("shot.png"));
  ASSERT_GT(png.size(), 10000u);
  EXPECT_EQ(png.substr(1, 3), "PNG");
  for (const char* figure : {"accuracy-epochs", "accuracy-time", "samples-per-second", "bytes-per-step",
                             "communication-wait", "staleness"}) {
    EXPECT_EQ(test::readFile(out + "/figures/" + figure + ".png").substr(1, 3), "PNG") << figure;
  }
  const std::string html = test::readFile(out + "/report.html");
  EXPECT_EQ(html.find("src=\"http"), std::string::npos);
  EXPECT_NE(html.find("failed: "), std::string::npos);
  EXPECT_NE(html.find("partition"), std::string::npos);  // the pipeline's error, in the table
  // The console's winners read the accuracy at the report's time, to the same tenth of a second.
  std::smatch atTime;
  ASSERT_TRUE(std::regex_search(r.output, atTime, std::regex("best accuracy after ([0-9]+\\.[0-9]) s: "))) << r.output;
  EXPECT_NE(html.find("Accuracy after " + atTime[1].str() + " s"), std::string::npos) << atTime[0];

  // runs.csv and evals.csv say what the JSON lines say.
  const auto runs = readCsv(out + "/runs.csv");
  ASSERT_EQ(runs.size(), 5u);
  auto col = header(runs[0]);
  for (size_t i = 1; i < runs.size(); ++i) {
    const auto& row = runs[i];
    const std::string metrics = out + "/runs/" + row[col["configuration"]] + ".r1/metrics.jsonl";
    if (row[col["configuration"]] == "pipeline-uncut") {
      EXPECT_EQ(row[col["status"]], "failed");
      EXPECT_NE(row[col["error"]].find("partition"), std::string::npos) << row[col["error"]];
      continue;
    }
    EXPECT_EQ(row[col["status"]], "ok") << row[col["configuration"]];
    const auto done = events(metrics, "done");
    ASSERT_EQ(done.size(), 1u) << metrics;
    EXPECT_EQ(std::stoll(row[col["steps"]]), done[0]["steps"].get<int64_t>());
    EXPECT_EQ(std::stod(row[col["samples_per_s"]]), done[0]["samples_per_s"].get<double>());
    EXPECT_EQ(std::stod(row[col["test_accuracy"]]), done[0]["test_accuracy"].get<double>());
    EXPECT_EQ(std::stoll(row[col["bytes_sent"]]), done[0]["bytes_sent"].get<int64_t>());
    EXPECT_EQ(std::stod(row[col["wall_s"]]), done[0]["wall_s"].get<double>());
  }
  const auto evals = readCsv(out + "/evals.csv");
  auto ecol = header(evals[0]);
  std::map<std::string, std::vector<std::vector<std::string>>> byConfig;
  for (size_t i = 1; i < evals.size(); ++i) byConfig[evals[i][ecol["configuration"]]].push_back(evals[i]);
  EXPECT_EQ(byConfig.size(), 3u);
  for (const auto& [config, rows] : byConfig) {
    const auto jsonEvals = events(out + "/runs/" + config + ".r1/metrics.jsonl", "eval");
    ASSERT_EQ(rows.size(), jsonEvals.size()) << config;
    EXPECT_GE(rows.size(), 3u) << config;
    for (size_t i = 0; i < rows.size(); ++i) {
      EXPECT_EQ(std::stoll(rows[i][ecol["step"]]), jsonEvals[i]["step"].get<int64_t>());
      EXPECT_EQ(std::stod(rows[i][ecol["accuracy"]]), jsonEvals[i]["accuracy"].get<double>());
      EXPECT_EQ(std::stod(rows[i][ecol["wall_s"]]), jsonEvals[i]["wall_s"].get<double>());
    }
  }

  // Run again: nothing is rerun, the report is rewritten from what is there.
  const auto before = fs::last_write_time(out + "/runs/allreduce.r1/metrics.jsonl");
  auto again = test::runCommand(compareCommand(dir.file("c.toml"), out), 300);
  ASSERT_EQ(again.exitCode, 0) << again.output;
  EXPECT_NE(again.output.find("allreduce.r1: ok (finished earlier)"), std::string::npos) << again.output;
  EXPECT_NE(again.output.find("pipeline-uncut.r1: FAILED (earlier)"), std::string::npos) << again.output;
  EXPECT_EQ(fs::last_write_time(out + "/runs/allreduce.r1/metrics.jsonl"), before);
}

// A command started with fork/exec in a process group of its own (killed whole at the end).
class Background {
 public:
  explicit Background(const std::string& command) {
    pid_ = ::fork();
    if (pid_ == 0) {
      ::setpgid(0, 0);
      ::execl("/bin/sh", "sh", "-c", ("exec " + command).c_str(), nullptr);
      ::_exit(127);
    }
    ::setpgid(pid_, pid_);
  }
  ~Background() {
    ::kill(-pid_, SIGKILL);
    ::waitpid(pid_, nullptr, 0);
  }
  // SIGKILL to the command alone (not its group): what its jobs do then is up to it.
  void killHard() {
    ::kill(pid_, SIGKILL);
    ::waitpid(pid_, nullptr, 0);
  }
  // `signo` to the command alone; its exit status once it ends (-1 if a signal ended it).
  int stop(int signo) {
    ::kill(pid_, signo);
    int status = 0;
    ::waitpid(pid_, &status, 0);
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  }

 private:
  pid_t pid_ = -1;
};

// Waits (at most `seconds`) until path exists.
bool waitForFile(const std::string& path, int seconds) { return test::waitForPath(path, std::chrono::seconds(seconds)); }


// The jobs of a killed runner end with it (they get SIGTERM when it dies): waits at most 60 s, on
// each job's exit (a pidfd turns readable when its process ends).
void expectJobsEnd(const std::string& out) {
  const auto deadline = Clock::now() + std::chrono::seconds(60);
  for (int pid : test::processesMentioning(out + "/runs/")) {
    const int fd = int(::syscall(SYS_pidfd_open, pid, 0));
    if (fd < 0) continue;  // already gone
    pollfd p{fd, POLLIN, 0};
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    ::poll(&p, 1, int(std::max<int64_t>(0, left.count())));
    ::close(fd);
  }
  EXPECT_TRUE(test::processesMentioning(out + "/runs/").empty()) << "a job outlived its killed runner";
}

// Bag-of-ids data compare as train takes them (compare refused them as an unknown data set): an
// epoch of synthetic-bags:N is N examples, of a libsvm file its examples less the test sixth.
TEST(Compare, BagDataSetsAreCompared) {
  test::TempDir dir;
  std::string file = "# label ids\n\n";
  for (int i = 0; i < 60; ++i) {
    file += std::to_string(i % 2) + " " + std::to_string(i % 7) + " 10 " + std::to_string(20 + i % 5) + "\n";
  }
  test::writeFile(dir.file("bags.txt"), file);
  // 120 examples are 12 steps of 10; the file's 60 less its 10 test examples are 5.
  const std::vector<std::pair<std::string, std::string>> cases{{"synthetic-bags:120,1000", "local,1,12,"},
                                                               {"libsvm:" + dir.file("bags.txt"), "local,1,5,"}};
  for (const auto& [data, lastEval] : cases) {
    const std::string out = dir.file(data.substr(0, 6));
    auto r = test::runCommand(test::cohortBinary() + " compare --only local --model embed:rows=1000 --data " + data +
                                  " --batch 10 --epochs 1 --evaluations 2 --no-png --out " + out,
                              300);
    ASSERT_EQ(r.exitCode, 0) << data << ": " << r.output;
    EXPECT_NE(r.output.find("(1 of 1 runs ok)"), std::string::npos) << r.output;
    EXPECT_NE(test::readFile(out + "/evals.csv").find(lastEval), std::string::npos) << test::readFile(out + "/evals.csv");
  }
}

// The figures' PNGs are made without a shell: an output folder with a quote in its name broke the
// command line, and the error blamed a missing rsvg-convert.
TEST(Compare, AnOutputFolderWithAQuoteGetsItsFigures) {
  test::TempDir dir;
  const std::string out = dir.file("it's");
  auto r = test::runCommand(test::cohortBinary() +
                                " compare --only local --model mlp --data synthetic:600 --steps 3"
                                " --out \"" +
                                out + "\"",
                            120);
  ASSERT_EQ(r.exitCode, 0) << r.output;
  EXPECT_EQ(test::readFile(out + "/figures/accuracy-epochs.png").substr(1, 3), "PNG");
}

TEST(Compare, AKilledComparisonResumes) {
  test::TempDir dir;
  const std::string out = dir.file("out");
  const std::string command = test::cohortBinary() +
                              " compare --only local,allreduce --model mlp --data synthetic:600 --batch 16 --seconds 2"
                              " --evaluations 2 --no-png --out " + out;
  {
    Background compare(command + " --runs 2 > " + dir.file("log1") + " 2>&1");
    ASSERT_TRUE(waitForFile(out + "/runs/local.r1/status.json", 120)) << test::readFile(dir.file("log1"));
    compare.killHard();
    expectJobsEnd(out);
  }
  const std::string localMetrics = test::readFile(out + "/runs/local.r1/metrics.jsonl");
  auto r = test::runCommand(command + " --runs 2", 600);
  ASSERT_EQ(r.exitCode, 0) << r.output;
  EXPECT_NE(r.output.find("local.r1: ok (finished earlier)"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("allreduce.r1: ok,"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("local.r2: ok,"), std::string::npos) << r.output;
  EXPECT_EQ(test::readFile(out + "/runs/local.r1/metrics.jsonl"), localMetrics);
  // A wall-clock budget: every run stopped at its first evaluation after 2 s, all ranks together.
  for (const char* run : {"local.r1", "local.r2", "allreduce.r1", "allreduce.r2"}) {
    const auto done = test::lastEvent(out + "/runs/" + run + "/metrics.jsonl", "done");
    ASSERT_FALSE(done.is_null()) << run;
    EXPECT_GE(done["wall_s"].get<double>(), 2.0) << run;
    const auto evals = events(out + "/runs/" + std::string(run) + "/metrics.jsonl", "eval");
    ASSERT_GE(evals.size(), 1u) << run;
    if (evals.size() >= 2) {
      EXPECT_LT(evals[evals.size() - 2]["wall_s"].get<double>(), 2.0) << run;
    }
  }
  // Medians of two runs: the spread is in the summary.
  const auto summary = readCsv(out + "/summary.csv");
  ASSERT_EQ(summary.size(), 3u);
  EXPECT_EQ(summary[1][1], "2");  // ok_runs
}

TEST(Sweep, FailedTrialsAreRecordedTheOthersRunAndTheBestAreKept) {
  test::TempDir dir;
  test::writeFile(dir.file("s.toml"),
                  "model = \"mlp\"\ndata = \"synthetic:600\"\nsteps = 10\nthreads = 1\n"
                  "lr = [0.01, 0.05]\nbatch = [16, -4]\n");
  const std::string out = dir.file("out");
  auto r = test::runCommand(test::cohortBinary() + " sweep " + dir.file("s.toml") + " --parallel 2 --top 1 --out " + out, 300);
  ASSERT_EQ(r.exitCode, 0) << r.output;
  EXPECT_NE(r.output.find("ranked by test accuracy"), std::string::npos) << r.output;
  const auto lines = test::lines(test::readFile(out + "/results.jsonl"));
  ASSERT_EQ(lines.size(), 4u);
  int ok = 0, failed = 0;
  for (const auto& line : lines) {
    auto j = nlohmann::json::parse(line);
    if (j["status"] == "ok") {
      ++ok;
      EXPECT_EQ(j["options"]["batch"], "16");
      EXPECT_GE(j["rank"].get<int>(), 1);
    } else {
      ++failed;
      EXPECT_EQ(j["options"]["batch"], "-4");
      EXPECT_NE(j["error"].get<std::string>().find("--batch must be positive"), std::string::npos) << j;
    }
  }
  EXPECT_EQ(ok, 2);
  EXPECT_EQ(failed, 2);
  EXPECT_EQ(nlohmann::json::parse(lines[0])["rank"], 1);  // the leaderboard's order
  int kept = 0;
  for (const auto& entry : fs::directory_iterator(out + "/top")) kept += entry.path().extension() == ".pt";
  EXPECT_EQ(kept, 1);
}

// --device reaches every trial: one no machine has fails each of them, naming it.
TEST(Sweep, TheDeviceReachesEveryTrial) {
  test::TempDir dir;
  test::writeFile(dir.file("s.toml"),
                  "model = \"mlp\"\ndata = \"synthetic:600\"\nsteps = 2\nthreads = 1\nlr = [0.01, 0.05]\n");
  const std::string out = dir.file("out");
  auto r =
      test::runCommand(test::cohortBinary() + " sweep " + dir.file("s.toml") + " --device cuda:99 --out " + out, 120);
  const auto lines = test::lines(test::readFile(out + "/results.jsonl"));
  ASSERT_EQ(lines.size(), 2u) << r.output;
  for (const auto& line : lines) {
    auto j = nlohmann::json::parse(line);
    EXPECT_EQ(j["status"], "failed") << j;
    EXPECT_NE(j["error"].get<std::string>().find("cuda:99"), std::string::npos) << j;
  }
}

// A device the model cannot train on stops a comparison before its first run, in one line.
TEST(Compare, ADeviceThatCannotTrainIsAnErrorBeforeAnyRun) {
  test::TempDir dir;
  const std::string out = dir.file("out");
  auto r = test::runCommand(test::cohortBinary() +
                                " compare --model mlp --data synthetic:600 --steps 2 --only "
                                "local,allreduce --device cuda:99 --out " +
                                out,
                            120);
  EXPECT_NE(r.exitCode, 0) << r.output;
  EXPECT_NE(r.output.find("--model mlp cannot be trained on --device cuda:99: "), std::string::npos) << r.output;
  EXPECT_FALSE(fs::exists(out)) << "a run started";
}

// --autocast reaches every run: their done events say bf16.
TEST(Compare, AutocastReachesEveryRun) {
  test::TempDir dir;
  const std::string out = dir.file("out");
  auto r = test::runCommand(test::cohortBinary() +
                                " compare --model mlp --data synthetic:600 --steps 3 --only local,allreduce "
                                "--autocast bf16 --no-png --out " +
                                out,
                            300);
  ASSERT_EQ(r.exitCode, 0) << r.output;
  for (const char* run : {"local.r1", "allreduce.r1"}) {
    const auto done = test::lastEvent(out + "/runs/" + run + "/metrics.jsonl", "done");
    ASSERT_FALSE(done.is_null()) << run << "\n" << r.output;
    EXPECT_EQ(done.value("autocast", ""), "bf16") << run;
  }
}

TEST(Sweep, AKilledSweepResumesWithoutRerunningFinishedTrials) {
  test::TempDir dir;
  // Each trial sleeps 0.2 s a step (--test-slow-worker), so the kill lands while trial 2 runs.
  test::writeFile(dir.file("s.toml"),
                  "model = \"mlp\"\ndata = \"synthetic:600\"\nsteps = 8\nthreads = 1\ntest_slow_worker = \"0:0.2\"\n"
                  "lr = [0.01, 0.02, 0.03]\n");
  const std::string out = dir.file("out");
  const std::string command = test::cohortBinary() + " sweep " + dir.file("s.toml") + " --out " + out;
  {
    Background sweep(command + " > " + dir.file("log1") + " 2>&1");
    ASSERT_TRUE(waitForFile(out + "/runs/trial-001/status.json", 120)) << test::readFile(dir.file("log1"));
    sweep.killHard();
    expectJobsEnd(out);
  }
  EXPECT_FALSE(fs::exists(out + "/runs/trial-003/status.json"));
  const std::string first = test::readFile(out + "/runs/trial-001/metrics.jsonl");
  {
    // Stopped, not killed: it stops its trial and exits with 128 + SIGTERM, as a shell reports a
    // process the signal ended (it was 1, a failure's status).
    Background sweep(command + " > " + dir.file("log2") + " 2>&1");
    // Once its runner runs: it has said so of the trial the first sweep finished.
    const auto until = Clock::now() + std::chrono::seconds(120);
    while (test::readFile(dir.file("log2")).find("trial-001: ok (finished earlier)") == std::string::npos &&
           Clock::now() < until) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    EXPECT_EQ(sweep.stop(SIGTERM), 128 + SIGTERM) << test::readFile(dir.file("log2"));
    EXPECT_NE(test::readFile(dir.file("log2")).find("interrupted by SIGTERM"), std::string::npos)
        << test::readFile(dir.file("log2"));
  }
  auto r = test::runCommand(command, 300);
  ASSERT_EQ(r.exitCode, 0) << r.output;
  EXPECT_NE(r.output.find("trial-001: ok (finished earlier)"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("trial-003: ok,"), std::string::npos) << r.output;
  EXPECT_EQ(test::readFile(out + "/runs/trial-001/metrics.jsonl"), first);
  EXPECT_EQ(test::lines(test::readFile(out + "/results.jsonl")).size(), 3u);
}

}  // namespace
}  // namespace cohort

namespace cohort {
namespace {

// --network: every process in a namespace of its own, the rendezvous at 10.77.0.1, which only the
// namespaces can reach (gossip's peers too, at their namespaces' addresses); the namespaces are
// gone afterwards. Needs root (fails, never skips).
TEST(Compare, EmulatedNetworkRunsEveryProcessInItsOwnNamespace) {
  ASSERT_EQ(::geteuid(), 0u) << "--network needs root to create network namespaces";
  test::TempDir dir;
  const std::string out = dir.file("out");
  auto r = test::runCommand(test::cohortBinary() +
                                " compare --only allreduce,ps-async,gossip --model mlp --data synthetic:600 --batch 16"
                                " --steps 6 --evaluations 1 --no-png --network 100mbit --out " + out,
                            300);
  ASSERT_EQ(r.exitCode, 0) << r.output;
  EXPECT_NE(r.output.find("allreduce.r1: ok"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("ps-async.r1: ok"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("gossip.r1: ok"), std::string::npos) << r.output;
  // Gossip peers publish the namespace's address, not the host's name (which names the machine
  // outside the namespace): no peer is lost.
  const std::string gossip = test::readFile(out + "/runs/gossip.r1/output.log");
  EXPECT_EQ(gossip.find("is lost"), std::string::npos) << gossip;
  EXPECT_EQ(gossip.find("stopped before the end"), std::string::npos) << gossip;
  const std::string status = test::readFile(out + "/runs/allreduce.r1/status.json");
  EXPECT_NE(status.find("MASTER_ADDR=10.77.0.1"), std::string::npos) << status;
  EXPECT_NE(status.find("ip netns exec cohort-"), std::string::npos) << status;
  EXPECT_NE(test::readFile(out + "/report.html").find("links of 100mbit"), std::string::npos);
  std::smatch tag;
  ASSERT_TRUE(std::regex_search(status, tag, std::regex("ip netns exec (cohort-[0-9]+)-")));
  auto list = test::runCommand("ip netns list", 30);
  EXPECT_EQ(list.output.find(tag[1].str() + "-"), std::string::npos) << list.output;

  // Run again: the finished run is kept though its namespaces had other names, and only run 2 is
  // new; on another link's rate it is another run.
  const std::string again = test::cohortBinary() +
                            " compare --only allreduce --model mlp --data synthetic:600 --batch 16 --steps 6"
                            " --evaluations 1 --no-png --out " + out;
  r = test::runCommand(again + " --runs 2 --network 100mbit", 300);
  ASSERT_EQ(r.exitCode, 0) << r.output;
  EXPECT_NE(r.output.find("allreduce.r1: ok (finished earlier)"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("allreduce.r2: ok, "), std::string::npos) << r.output;
  r = test::runCommand(again + " --runs 1 --network 1gbit", 300);
  ASSERT_EQ(r.exitCode, 0) << r.output;
  EXPECT_NE(r.output.find("allreduce.r1: ok, "), std::string::npos) << r.output;
}

}  // namespace
}  // namespace cohort
