// The runner under `cohort compare` and `cohort sweep` (jobs as processes, failures recorded,
// resuming), the search space, the charts, and both commands' bad input. Fast: the jobs here are
// shell one-liners, and the command-line errors come before anything runs.
#include "experiment/plan.h"
#include "experiment/remote.h"
#include "experiment/report.h"
#include "experiment/runner.h"
#include "experiment/svg_chart.h"
#include "experiment/sweep.h"

#include "test_util.h"

#include <regex>
#include <set>

namespace cohort {
namespace {

using experiment::JobSpec;
using experiment::JobStatus;

JobSpec shellJob(const std::string& id, const std::string& script) {
  return JobSpec{.id = id, .processes = {{.argv = {"/bin/sh", "-c", script}}}};
}

TEST(Runner, AFailedJobIsRecordedWithItsErrorAndTheOthersRun) {
  test::TempDir dir;
  const std::vector<JobSpec> jobs{
      shellJob("a", "echo hello; exit 0"),
      shellJob("b", "echo working; echo '[rank 1] cohort: error: the model cannot be cut here' >&2; exit 3"),
      shellJob("c", "echo fine"),
  };
  const auto records = experiment::runJobs(jobs, {.dir = dir.path(), .parallel = 2});
  ASSERT_EQ(records.size(), 3u);
  EXPECT_EQ(records[0].status, JobStatus::kOk);
  EXPECT_EQ(records[1].status, JobStatus::kFailed);
  EXPECT_EQ(records[1].exitCode, 3);
  EXPECT_EQ(records[1].error, "the model cannot be cut here");
  EXPECT_EQ(records[2].status, JobStatus::kOk);
  EXPECT_NE(test::readFile(dir.file("runs/a/output.log")).find("hello"), std::string::npos);
  const auto status = nlohmann::json::parse(test::readFile(dir.file("runs/b/status.json")));
  EXPECT_EQ(status["status"], "failed");
  EXPECT_EQ(status["error"], "the model cannot be cut here");
}

TEST(Runner, FinishedJobsAreNotRunAgainAndAChangedCommandIs) {
  test::TempDir dir;
  const std::string counter = dir.file("count");
  std::vector<JobSpec> jobs{shellJob("one", "echo x >> " + counter), shellJob("two", "echo y >> " + counter + "; exit 1")};
  experiment::runJobs(jobs, {.dir = dir.path()});
  auto again = experiment::runJobs(jobs, {.dir = dir.path()});
  EXPECT_EQ(test::readFile(counter), "x\ny\n");  // neither ran twice: the failure is kept too
  EXPECT_TRUE(again[0].resumed);
  EXPECT_TRUE(again[1].resumed);
  EXPECT_EQ(again[1].status, JobStatus::kFailed);
  jobs[0] = shellJob("one", "echo z >> " + counter);  // another command under the same name
  again = experiment::runJobs(jobs, {.dir = dir.path()});
  EXPECT_EQ(test::readFile(counter), "x\ny\nz\n");
  EXPECT_FALSE(again[0].resumed);
}

TEST(Runner, ATimedOutJobFailsAndItsProcessesEnd) {
  test::TempDir dir;
  const auto records = experiment::runJobs({shellJob("slow", "echo $$ > " + dir.file("pid") + "; exec sleep 60")},
                                           {.dir = dir.path(), .timeoutSeconds = 1, .graceSeconds = 1});
  EXPECT_EQ(records[0].status, JobStatus::kFailed);
  EXPECT_NE(records[0].error.find("timed out after 1 s"), std::string::npos) << records[0].error;
  const int pid = std::stoi(test::readFile(dir.file("pid")));
  EXPECT_NE(::kill(pid, 0), 0);  // reaped: gone
}

TEST(Runner, ServersAreStoppedWhenTheWorkersAreDone) {
  test::TempDir dir;
  JobSpec job{.id = "ps", .processes = {{.argv = {"/bin/sh", "-c", "exit 0"}},
                                        {.argv = {"/bin/sh", "-c", "exec sleep 60"}, .waitedFor = false}}};
  const auto records = experiment::runJobs({job}, {.dir = dir.path(), .graceSeconds = 5});
  EXPECT_EQ(records[0].status, JobStatus::kOk);
  EXPECT_LT(records[0].wallSeconds, 30);
}

// A process with an input (a remote shell, experiment/remote.h) reads it, and is ended by its EOF
// rather than by a signal: here a "shard" the job stops once its worker is done.
TEST(Runner, AnInputIsReadAndItsEndStopsTheProcess) {
  test::TempDir dir;
  const std::string script = "IFS= read -r t; echo \"$t\" > " + dir.file("token") + "; cat > /dev/null; echo eof > " +
                             dir.file("eof");
  JobSpec job{.id = "remote",
              .processes = {{.argv = {"/bin/sh", "-c", "exit 0"}},
                            {.argv = {"/bin/sh", "-c", script}, .waitedFor = false, .input = "s3cret\n"}}};
  const auto records = experiment::runJobs({job}, {.dir = dir.path(), .graceSeconds = 60});
  EXPECT_EQ(records[0].status, JobStatus::kOk) << records[0].error;
  EXPECT_LT(records[0].wallSeconds, 30);  // ended by the EOF, not by SIGKILL after the grace
  EXPECT_EQ(test::readFile(dir.file("token")), "s3cret\n");
  EXPECT_EQ(test::readFile(dir.file("eof")), "eof\n");
  EXPECT_EQ(test::readFile(dir.file("runs/remote/status.json")).find("s3cret"), std::string::npos);
}

TEST(Remote, PlacementPortsAndVariables) {
  experiment::RemoteHosts hosts{.hosts = {"a", "me@b"}, .shell = "rsh -l x {host}", .binary = "/opt/cohort",
                                .workdir = "/shared/w", .basePort = 4000};
  const std::vector<std::string> train{"/local/cohort", "train", "--metrics", "out/runs/x.r1/metrics.jsonl"};
  // Three ranks and two shards on two hosts: process i on host i mod 2, at port 4000 + i.
  const auto ps = experiment::remoteProcesses(hosts, 3, 2, train);
  ASSERT_EQ(ps.size(), 5u);
  const std::string cluster = R"("chief":["a:4000"],"worker":["b:4001","a:4002"],"ps":["b:4003","a:4004"])";
  for (size_t i = 0; i < ps.size(); ++i) {
    const auto& argv = ps[i].argv;
    ASSERT_EQ(argv.size(), 5u);
    EXPECT_EQ(argv[0], "rsh");
    EXPECT_EQ(argv[3], i % 2 == 0 ? "a" : "me@b");
    const std::string& remote = argv[4];
    EXPECT_NE(remote.find(cluster), std::string::npos) << remote;
    EXPECT_NE(remote.find(" /opt/cohort train --metrics out/runs/x.r1/metrics.jsonl"), std::string::npos) << remote;
    EXPECT_EQ(remote.find("/local/cohort"), std::string::npos) << remote;
    EXPECT_NE(remote.find("cohort-remote /shared/w " + argv[3] + (i % 2 == 0 ? " 3 env" : " 2 env")), std::string::npos)
        << remote;  // the job's processes on that host share its cores
    ASSERT_TRUE(ps[i].input.has_value());
    EXPECT_EQ(*ps[i].input, *ps[0].input);  // one token per job, on stdin only
    EXPECT_GE(ps[i].input->size(), 17u);
    EXPECT_EQ(remote.find(ps[i].input->substr(0, 16)), std::string::npos);
    EXPECT_EQ(ps[i].waitedFor, i < 3);
  }
  EXPECT_NE(ps[0].argv[4].find(R"("task":{"type":"chief","index":0})"), std::string::npos);
  EXPECT_NE(ps[2].argv[4].find(R"("task":{"type":"worker","index":1})"), std::string::npos);
  EXPECT_NE(ps[4].argv[4].find(R"("task":{"type":"ps","index":1})"), std::string::npos);
  // Three ranks of allreduce: torchrun's variables, the rendezvous on the first host.
  const auto ar = experiment::remoteProcesses(hosts, 3, 0, train);
  ASSERT_EQ(ar.size(), 3u);
  EXPECT_NE(ar[2].argv[4].find("LOCAL_RANK=1 LOCAL_WORLD_SIZE=2 MASTER_ADDR=a MASTER_PORT=4000 RANK=2 WORLD_SIZE=3"),
            std::string::npos) << ar[2].argv[4];
  EXPECT_NE(ar[1].argv[4].find("LOCAL_RANK=0 LOCAL_WORLD_SIZE=1 MASTER_ADDR=a MASTER_PORT=4000 RANK=1 WORLD_SIZE=3"),
            std::string::npos) << ar[1].argv[4];
  // One process: on the first host, without rank variables.
  const auto local = experiment::remoteProcesses(hosts, 1, 0, train);
  ASSERT_EQ(local.size(), 1u);
  EXPECT_EQ(local[0].argv[3], "a");
  EXPECT_EQ(local[0].argv[4].find("RANK="), std::string::npos);
}

TEST(Remote, HostListsAndShellWords) {
  EXPECT_EQ(experiment::parseHostList(" a, me@b ,,10.0.0.5", ',', "--hosts"),
            (std::vector<std::string>{"a", "me@b", "10.0.0.5"}));
  EXPECT_EQ(experiment::parseHostList("# the rack\nn1\nn2  # spare\n\n", '\n', "f"),
            (std::vector<std::string>{"n1", "n2"}));
  EXPECT_EQ(experiment::addressOf("me@b"), "b");
  EXPECT_THROW(experiment::parseHostList("a;rm -rf x", ',', "--hosts"), InvalidArgument);
  EXPECT_THROW(experiment::parseHostList(" , ", ',', "--hosts"), InvalidArgument);
  EXPECT_THROW(experiment::parseHostList("-oProxyCommand=x", ',', "--hosts"), InvalidArgument);
  EXPECT_EQ(experiment::splitShellWords("ssh -i 'my key' -o \"A=b c\" {host}"),
            (std::vector<std::string>{"ssh", "-i", "my key", "-o", "A=b c", "{host}"}));
  EXPECT_EQ(experiment::remoteShellArgv("ssh -l u{host}x {host}", "h", "true"),
            (std::vector<std::string>{"ssh", "-l", "uhx", "h", "true"}));
  EXPECT_THROW(experiment::splitShellWords("ssh 'open {host}"), InvalidArgument);
  EXPECT_THROW(experiment::splitShellWords("ssh host"), InvalidArgument);
  EXPECT_THROW(experiment::splitShellWords("  "), InvalidArgument);
}

// ssh hands the remote command to the host's login shell as one string; a csh user's tcsh refused
// the scripts while they spanned lines ("Unmatched '''."). Here tcsh stands in for that shell.
TEST(Remote, ScriptsRunUnderACshLoginShell) {
  ASSERT_EQ(::access("/usr/bin/tcsh", X_OK), 0) << "no /usr/bin/tcsh: scripts/setup.sh installs it";
  test::TempDir dir;
  const std::string shell = "env COHORT_TEST_HOST={host} /usr/bin/tcsh -f -c";
  experiment::RemoteHosts hosts{.hosts = {"localhost"}, .shell = shell, .binary = "/bin/sh", .workdir = dir.path()};
  EXPECT_NO_THROW(experiment::checkHosts(hosts, dir.path(), {}, 30));
  const std::vector<std::string> train{"cohort", "-c", "echo \"$COHORT_AUTH_TOKEN\" > ran"};
  std::vector<experiment::ProcessSpec> processes = experiment::remoteProcesses(hosts, 1, 0, train);
  ASSERT_EQ(processes.size(), 1u);
  const std::string input = processes[0].input.value_or("");
  const auto records = experiment::runJobs({{.id = "csh", .processes = std::move(processes)}},
                                           {.dir = dir.path(), .timeoutSeconds = 60});
  EXPECT_EQ(records[0].status, JobStatus::kOk) << records[0].error;
  EXPECT_EQ(test::readFile(dir.file("ran")), input);  // the command ran, with the token from stdin
}

TEST(Runner, BadIdsAreRefused) {
  test::TempDir dir;
  EXPECT_THROW(experiment::runJobs({shellJob("../x", "true")}, {.dir = dir.path()}), InvalidArgument);
  EXPECT_THROW(experiment::runJobs({shellJob("a", "true"), shellJob("a", "true")}, {.dir = dir.path()}), InvalidArgument);
}

TEST(Runner, ErrorFromLog) {
  EXPECT_EQ(experiment::errorFromLog("x\n[rank 0] cohort: error: lost rank 1\ncohort launch: rank 0 exited with status 1\n"),
            "lost rank 1");
  EXPECT_EQ(experiment::errorFromLog("a\ncohort launch: rank 1 was killed by signal 9 (SIGKILL)\n"),
            "cohort launch: rank 1 was killed by signal 9 (SIGKILL)");
  EXPECT_EQ(experiment::errorFromLog("a\nSegmentation fault\n"), "Segmentation fault");
  EXPECT_EQ(experiment::errorFromLog(""), "");
}

experiment::OptionCatalog catalog() {
  return {.takesValue = {{"lr", true}, {"batch", true}, {"model", true}, {"no-overlap", false}, {"steps", true},
                         {"metrics", true}}};
}

// Every scheme train runs can be compared (the file knew 6 of the 10 before): the in-process ones
// default to one process, tensor to two, and the copies that share the data follow --ways.
TEST(Compare, EverySchemeTrainKnowsPlansWithItsProcessesAndReplicas) {
  test::TempDir dir;
  test::writeFile(dir.file("c.toml"),
                  "[[configuration]]\nstrategy = \"tensor\"\n[[configuration]]\nstrategy = \"tensor\"\nworkers = 4\n"
                  "[[configuration]]\nstrategy = \"hogwild\"\n[[configuration]]\nstrategy = \"mirrored\"\nworkers = 2\n");
  const auto file = experiment::readCompareFile(dir.file("c.toml"), catalog());
  ASSERT_EQ(file.configurations.size(), 4u);
  EXPECT_EQ(file.configurations[0].scheme, Scheme::kTensor);
  EXPECT_EQ(file.configurations[0].workers, 2);
  EXPECT_EQ(file.configurations[0].replicas(), 1);
  EXPECT_EQ(file.configurations[1].replicas(), 2);
  EXPECT_EQ(file.configurations[2].workers, 1);
  EXPECT_EQ(file.configurations[2].name, "hogwild-3");
  EXPECT_EQ(file.configurations[3].replicas(), 2);
  // Names whose job ids are the same: refused while reading, naming both (the runner refused
  // "two runs are named 'a_b.r1'" later).
  test::writeFile(dir.file("ids.toml"), "[[configuration]]\nname = \"a b\"\nstrategy = \"local\"\n"
                                        "[[configuration]]\nname = \"a_b\"\nstrategy = \"local\"\n");
  try {
    experiment::readCompareFile(dir.file("ids.toml"), catalog());
    ADD_FAILURE() << "'a b' and 'a_b' were accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("configuration 2: the names 'a b' and 'a_b' both make the run id 'a_b.r1'"),
              std::string::npos)
        << e.what();
  }
  test::writeFile(dir.file("bad.toml"), "[[configuration]]\nstrategy = \"central\"\nworkers = 2\n");
  try {
    experiment::readCompareFile(dir.file("bad.toml"), catalog());
    ADD_FAILURE() << "central over 2 processes was accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("configuration 1: strategy central runs 1 process"), std::string::npos)
        << e.what();
  }
}

TEST(Sweep, GridIsEveryCombination) {
  test::TempDir dir;
  test::writeFile(dir.file("s.toml"),
                  "model = \"mlp\"\nlr = [0.01, 0.1]\nbatch = { min = 16, max = 64, steps = 3 }\nno_overlap = [true, false]\n");
  const auto space = experiment::readSweepFile(dir.file("s.toml"), catalog());
  const auto trials = experiment::expandTrials(space);
  ASSERT_EQ(trials.size(), 12u);
  EXPECT_EQ(*experiment::findArg(space.fixed, "--model"), "mlp");
  EXPECT_EQ(*experiment::findArg(trials[0].chosen, "--lr"), "0.01");
  EXPECT_EQ(*experiment::findArg(trials[0].chosen, "--batch"), "16");
  EXPECT_NE(experiment::findArg(trials[0].chosen, "--no-overlap"), nullptr);
  EXPECT_EQ(experiment::findArg(trials[1].chosen, "--no-overlap"), nullptr);
  EXPECT_EQ(*experiment::findArg(trials[2].chosen, "--batch"), "40");
  EXPECT_EQ(*experiment::findArg(trials[11].chosen, "--lr"), "0.1");
  EXPECT_EQ(trials[11].id, "trial-012");
}

TEST(Sweep, RandomDrawsAreSeededAndInRange) {
  test::TempDir dir;
  test::writeFile(dir.file("s.toml"), "lr = { min = 0.001, max = 0.1, log = true }\nbatch = { min = 8, max = 12 }\n"
                                      "[sweep]\nmode = \"random\"\ntrials = 20\nseed = 7\n");
  const auto space = experiment::readSweepFile(dir.file("s.toml"), catalog());
  const auto a = experiment::expandTrials(space);
  const auto b = experiment::expandTrials(space);
  ASSERT_EQ(a.size(), 20u);
  std::set<std::string> batches;
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].chosen, b[i].chosen);
    const double lr = std::stod(*experiment::findArg(a[i].chosen, "--lr"));
    EXPECT_GE(lr, 0.001);
    EXPECT_LE(lr, 0.1);
    const int batch = std::stoi(*experiment::findArg(a[i].chosen, "--batch"));
    EXPECT_GE(batch, 8);
    EXPECT_LE(batch, 12);
    batches.insert(std::to_string(batch));
  }
  EXPECT_GE(batches.size(), 3u);  // integers drawn, not one value
}

// An integer range with log = true is drawn log-uniformly: batch in [16, 1024] is at most 64 in
// log(65 / 16) / log(1025 / 16) = 34% of the trials (a uniform draw over the integers gives 5%).
TEST(Sweep, RandomIntegerLogRangeIsLogUniform) {
  test::TempDir dir;
  test::writeFile(dir.file("s.toml"),
                  "batch = { min = 16, max = 1024, log = true }\n[sweep]\nmode = \"random\"\ntrials = 2000\nseed = 3\n");
  const auto trials = experiment::expandTrials(experiment::readSweepFile(dir.file("s.toml"), catalog()));
  ASSERT_EQ(trials.size(), 2000u);
  int small = 0, lowest = 0;
  for (const auto& t : trials) {
    const int batch = std::stoi(*experiment::findArg(t.chosen, "--batch"));
    ASSERT_GE(batch, 16);
    ASSERT_LE(batch, 1024);
    small += batch <= 64;
    lowest += batch == 16;
  }
  // Binomial(2000, 0.337): a standard deviation of 21 trials.
  EXPECT_NEAR(small / 2000.0, std::log(65.0 / 16) / std::log(1025.0 / 16), 0.05) << small;
  EXPECT_GT(lowest, 0);
}

TEST(Sweep, BadFilesNameTheOption) {
  test::TempDir dir;
  auto error = [&](const std::string& text) {
    test::writeFile(dir.file("s.toml"), text);
    try {
      experiment::readSweepFile(dir.file("s.toml"), catalog());
    } catch (const InvalidArgument& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(error("learning_speed = [1, 2]\n").find("unknown option 'learning_speed'"), std::string::npos);
  EXPECT_NE(error("lr = []\n").find("option 'lr' has an empty list"), std::string::npos);
  EXPECT_NE(error("lr = { min = 0.1, max = 0.01, steps = 2 }\n").find("option 'lr' has an empty range"), std::string::npos);
  EXPECT_NE(error("lr = { min = 0.01, max = 0.1 }\n").find("needs steps = N"), std::string::npos);
  EXPECT_NE(error("metrics = \"x\"\n").find("set by cohort itself"), std::string::npos);
  EXPECT_NE(error("[sweep]\nmode = \"random\"\n").find("trials = N"), std::string::npos);
  // A file with no keys would sweep nothing: one trial of the defaults.
  EXPECT_EQ(error("# lr = [0.1]\n"),
            "the sweep file " + dir.file("s.toml") +
                ": is empty; a sweep file names the options to try, one per line: lr = [0.01, 0.1]");
  EXPECT_NE(error("lr = [0.1\n").find(dir.file("s.toml") + ":1: "), std::string::npos);
  try {
    experiment::readSweepFile(dir.path(), catalog());
    ADD_FAILURE() << "a directory was read as a sweep file";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("the sweep file " + dir.path() + ": is a directory"), std::string::npos)
        << e.what();
  }
}

TEST(Svg, ChartsCountTheirSeries) {
  experiment::LineChart line{"acc", "Accuracy <&>", "epochs", "accuracy",
                             {{"a", {{0, 0.1}, {1, 0.5}}}, {"b", {{0, 0.2}, {1, 0.7}}}}};
  const std::string svg = experiment::renderLineChart(line);
  EXPECT_NE(svg.find("data-series=\"2\""), std::string::npos);
  EXPECT_NE(svg.find("Accuracy &lt;&amp;&gt;"), std::string::npos);
  EXPECT_EQ(std::regex_search(svg, std::regex("<g class=\"series\"")), true);
  size_t groups = 0;
  for (size_t at = svg.find("class=\"series\""); at != std::string::npos; at = svg.find("class=\"series\"", at + 1)) ++groups;
  EXPECT_EQ(groups, 2u);
  experiment::BarChart bars{"speed", "Speed", "samples/s", {{"x", 10, 8, 12}, {"y", 5, 5, 5}, {"z", 0, 0, 0}}};
  EXPECT_NE(experiment::renderBarChart(bars).find("data-series=\"3\""), std::string::npos);
}

TEST(Plan, DefaultSetHasTheSeedsSchemes) {
  const auto configs = experiment::defaultConfigurations(2, "fp16");
  std::set<std::string> names;
  for (const auto& c : configs) names.insert(c.name);
  for (const char* n : {"local", "allreduce", "average-k4", "average-k16", "ps-sync", "ps-sync-backup", "ps-async",
                        "ps-softsync", "ps-ssp", "gossip", "pipeline", "allreduce+fp16", "ps-async+fp16", "gossip+fp16"}) {
    EXPECT_TRUE(names.count(n)) << n;
  }
  EXPECT_FALSE(names.count("pipeline+fp16"));
  EXPECT_EQ(experiment::stepsPerEpoch(60000, 2, 64), 469);
  EXPECT_EQ(experiment::trainingExamples("synthetic:600"), 600);
  EXPECT_THROW(experiment::trainingExamples("imagenet"), InvalidArgument);
}

// Bag-of-ids data sets count as train reads them: synthetic-bags makes N (60000), a libsvm file has
// one example a line but blank ones and comments, and without a TEST file its last sixth is the
// test set.
TEST(Plan, BagDataSetsAreCounted) {
  EXPECT_EQ(experiment::trainingExamples("synthetic-bags"), 60000);
  EXPECT_EQ(experiment::trainingExamples("synthetic-bags:600,5000"), 600);
  EXPECT_EQ(experiment::trainingExamples("synthetic-bags:600"), 600);
  test::TempDir dir;
  std::string file = "# label ids\n\n";
  for (int i = 0; i < 12; ++i) file += "1 3 4\n   \n";
  test::writeFile(dir.file("b.txt"), file);
  EXPECT_EQ(experiment::trainingExamples("libsvm:" + dir.file("b.txt")), 10);
  EXPECT_EQ(experiment::trainingExamples("libsvm:" + dir.file("b.txt") + "," + dir.file("t.txt")), 12);
  try {
    experiment::trainingExamples("libsvm:" + dir.file("none.txt"));
    ADD_FAILURE() << "counted a missing file";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("cannot open " + dir.file("none.txt")), std::string::npos) << e.what();
  }
  EXPECT_THROW(experiment::trainingExamples("synthetic-bags:x"), InvalidArgument);
}

// The examples --validation holds out are not part of an epoch: the evaluation points and the
// report's time per epoch count the training set less them (the shared option, or the
// configuration's own).
TEST(Plan, EpochsCountTheTrainingSetLessTheValidationExamples) {
  experiment::PlanOptions plan;
  plan.binary = "cohort";
  plan.budget.epochs = 1;
  plan.evaluations = 10;
  plan.trainExamples = 60000;
  plan.shared = {{"--batch", "64"}, {"--validation", "10000"}};
  const experiment::Configuration allreduce{"allreduce", Scheme::kAllreduce, 2, 0, {}};
  auto evalEvery = [&](const experiment::Configuration& c) {
    const std::vector<std::string> argv = experiment::trainCommand(c, plan, "m.jsonl");
    auto it = std::find(argv.begin(), argv.end(), "--eval-every");
    return it == argv.end() || it + 1 == argv.end() ? std::string("none") : *(it + 1);
  };
  // 50000 examples over 2 replicas of 64: 391 steps an epoch, an evaluation every 39 (not 469, 46).
  EXPECT_EQ(evalEvery(allreduce), "39");
  experiment::Configuration own = allreduce;
  own.options = {{"--validation", "30000"}};
  EXPECT_EQ(evalEvery(own), "23");  // 30000 / 2 / 64: 235 steps
  own.options = {{"--validation", "60000"}};
  try {
    evalEvery(own);
    ADD_FAILURE() << "planned an epoch of no examples";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("allreduce: validation = 60000 must be a whole number from 0 to below the "
                                         "60000 training examples"),
              std::string::npos)
        << e.what();
  }

  // 50000 examples at 1000 samples/s: 50 s per epoch in the runs table.
  experiment::ConfigResult result;
  result.config = allreduce;
  result.epochExamples = experiment::epochExamples(allreduce, plan);
  EXPECT_EQ(result.epochExamples, 50000);
  experiment::JobRecord record;
  record.id = "allreduce.r1";
  record.status = JobStatus::kOk;
  experiment::RunData data;
  data.hasDone = true;
  data.steps = 391;
  data.samplesPerSecond = 1000;
  data.evals = {{.step = 391, .epochs = 1, .accuracy = 0.5, .loss = 1, .wallSeconds = 50}};
  result.runs = {record};
  result.data = {data};
  experiment::ReportInput input;
  input.title = "t";
  input.trainExamples = plan.trainExamples;
  input.configs = {result};
  test::TempDir dir;
  const std::string html = test::readFile(experiment::writeReport(input, dir.path(), {.png = false}));
  EXPECT_NE(html.find("<td class=\"num\">50.0</td>"), std::string::npos) << html;
}

// A compare file's top-level options go to every run; one of another scheme's (period beside an
// allreduce run) is left out of that run, which train would refuse, and a configuration's own go
// as given.
TEST(Plan, SharedOptionsOfOtherSchemesAreLeftOut) {
  experiment::PlanOptions plan;
  plan.binary = "cohort";
  plan.budget.steps = 10;
  plan.shared = {{"--batch", "32"}, {"--period", "8"}, {"--codec", "fp16"}, {"--softsync", "2"}};
  auto argvOf = [&](const experiment::Configuration& c) {
    const std::vector<std::string> argv = experiment::trainCommand(c, plan, "m.jsonl");
    return std::set<std::string>(argv.begin(), argv.end());
  };
  const auto allreduce = argvOf({"allreduce", Scheme::kAllreduce, 2, 0, {}});
  EXPECT_EQ(allreduce.count("--period"), 0u);
  EXPECT_EQ(allreduce.count("--softsync"), 0u);
  EXPECT_EQ(allreduce.count("--codec"), 1u);
  EXPECT_EQ(allreduce.count("--batch"), 1u);
  EXPECT_EQ(argvOf({"average", Scheme::kAverage, 2, 0, {}}).count("--period"), 1u);
  const auto local = argvOf({"local", Scheme::kLocal, 1, 0, {}});
  EXPECT_EQ(local.count("--codec"), 0u);
  EXPECT_EQ(local.count("--batch"), 1u);
  EXPECT_EQ(argvOf({"ps", Scheme::kPs, 2, 1, {}}).count("--softsync"), 0u);  // train's default mode: async
  EXPECT_EQ(argvOf({"ps-soft", Scheme::kPs, 2, 1, {{"--ps-mode", "softsync"}}}).count("--softsync"), 1u);
  EXPECT_EQ(argvOf({"own", Scheme::kAllreduce, 2, 0, {{"--period", "4"}}}).count("--period"), 1u);
}

// A sweep that draws --strategy leaves out of each trial the fixed options of the other schemes;
// one that does not keeps every fixed option, for train to refuse a wrong one.
TEST(Sweep, DrawnSchemesLeaveOutTheFixedOptionsOfOthers) {
  test::TempDir dir;
  test::writeFile(dir.file("s.toml"), "period = 8\nbatch = 32\nstrategy = [\"allreduce\", \"average\"]\n");
  const experiment::OptionCatalog options{
      .takesValue = {{"lr", true}, {"batch", true}, {"period", true}, {"strategy", true}}};
  const auto space = experiment::readSweepFile(dir.file("s.toml"), options);
  const auto trials = experiment::expandTrials(space);
  ASSERT_EQ(trials.size(), 2u);
  const auto first = experiment::trialOptions(space, trials[0]);
  EXPECT_EQ(*experiment::findArg(first, "--strategy"), "allreduce");
  EXPECT_EQ(experiment::findArg(first, "--period"), nullptr);
  EXPECT_EQ(*experiment::findArg(first, "--batch"), "32");
  EXPECT_EQ(*experiment::findArg(experiment::trialOptions(space, trials[1]), "--period"), "8");
  test::writeFile(dir.file("fixed.toml"), "period = 8\nstrategy = \"allreduce\"\nlr = [0.1, 0.2]\n");
  const auto fixed = experiment::readSweepFile(dir.file("fixed.toml"), options);
  EXPECT_EQ(*experiment::findArg(experiment::trialOptions(fixed, experiment::expandTrials(fixed)[0]), "--period"), "8");
}

// Command-line errors: one line, before any run starts.
void expectOneLineError(const std::string& args, const std::string& needle) {
  auto r = test::runCommand(test::cohortBinary() + " " + args, 60);
  EXPECT_EQ(r.exitCode, 2) << args << "\n" << r.output;
  auto lines = test::lines(r.output);
  ASSERT_EQ(lines.size(), 1u) << args << "\n" << r.output;
  EXPECT_EQ(lines[0].rfind("cohort: error: ", 0), 0u) << lines[0];
  EXPECT_NE(lines[0].find(needle), std::string::npos) << "expected '" << needle << "' in: " << lines[0];
}

TEST(SweepCli, UnknownOptionAndEmptyRange) {
  test::TempDir dir;
  test::writeFile(dir.file("a.toml"), "model = \"mlp\"\nlearning_speed = [1, 2]\n");
  expectOneLineError("sweep " + dir.file("a.toml") + " --out " + dir.file("out"), "unknown option 'learning_speed'");
  test::writeFile(dir.file("b.toml"), "lr = { min = 0.5, max = 0.1, steps = 3 }\n");
  expectOneLineError("sweep " + dir.file("b.toml") + " --out " + dir.file("out"), "option 'lr' has an empty range");
  EXPECT_FALSE(std::filesystem::exists(dir.file("out")));
}

TEST(CompareCli, BadInputBeforeAnythingStarts) {
  test::TempDir dir;
  const std::string out = " --out " + dir.file("out");
  expectOneLineError("compare --epochs 0" + out, "--epochs must be positive");
  test::writeFile(dir.file("c.toml"), "model = \"mlp\"\n[[configuration]]\nstrategy = \"telepathy\"\n");
  expectOneLineError("compare " + dir.file("c.toml") + out, "unknown scheme 'telepathy'");
  test::writeFile(dir.file("d.toml"), "[[configuration]]\nstrategy = \"allreduce\"\nbukcet_mb = 4\n");
  expectOneLineError("compare " + dir.file("d.toml") + out, "unknown option 'bukcet_mb'");
  expectOneLineError("compare --model resnet --data synthetic:60" + out, "--model resnet cannot be trained by any scheme");
  // Bag data reach the model's check, which trains on bags: an image model is refused by name.
  expectOneLineError("compare --model mlp --data synthetic-bags:60" + out,
                     "--model mlp cannot be trained by any scheme: --model mlp reads images, but the data are bags");
  EXPECT_FALSE(std::filesystem::exists(dir.file("out")));
}

TEST(CompareCli, HostOptionsAreCheckedBeforeAnythingStarts) {
  test::TempDir dir;
  const std::string out = " --model mlp --data synthetic:60 --steps 2 --out " + dir.file("out");
  expectOneLineError("compare --hosts a,b --network 100mbit" + out, "does not go with --hosts");
  expectOneLineError("compare --remote-shell 'ssh {host}'" + out, "--remote-shell goes with --hosts");
  expectOneLineError("compare --hosts a --hostfile " + dir.file("h") + out, "give --hosts or --hostfile, not both");
  expectOneLineError("compare --hostfile " + dir.file("missing") + out,
                     "--hostfile " + dir.file("missing") + ": no such file");
  expectOneLineError("compare --hostfile " + dir.path() + out,
                     "--hostfile " + dir.path() + ": is a directory, not a file");
  expectOneLineError("compare --hosts 'a b'" + out, "'a b' is not a host");
  // A budget of 0 is refused, not taken for "not given" (which would run the default epoch).
  const std::string dataOut = " --model mlp --data synthetic:60 --out " + dir.file("out");
  expectOneLineError("compare --steps 0" + dataOut, "--steps must be positive");
  expectOneLineError("compare --examples 0" + dataOut, "--examples must be positive");
  expectOneLineError("compare --seconds 0" + dataOut, "--seconds must be positive");
  expectOneLineError("compare --steps 2 --seconds 1" + dataOut, "give one budget");
  expectOneLineError("compare --hosts a --remote-shell 'ssh -p 2222'" + out, "write {host}");
  expectOneLineError("compare --hosts a --base-port 70000" + out, "--base-port 70000");
  // A host that refuses the connection (nothing listens at a reserved port): named, nothing run.
  test::ReservedPort closed;
  expectOneLineError("compare --hosts 127.0.0.1 --remote-shell 'ssh -F /dev/null -o BatchMode=yes -p " +
                         std::to_string(closed.port()) + " {host}'" + out,
                     "host 127.0.0.1 does not answer through the remote shell");
  EXPECT_FALSE(std::filesystem::exists(dir.file("out")));
}

}  // namespace
}  // namespace cohort
