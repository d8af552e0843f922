// cohort train --profile: the PyTorch profiler over a window of steps, through the binary.
#include <nlohmann/json.hpp>

#include "test_util.h"

#include <filesystem>
#include <set>

namespace cohort::profile_test {
namespace {

const std::string kRun = " train --model mlp --data fashion-mnist --threads 1 --batch 32 --timeout 60";

// The operators a trace holds by name (Chrome's trace format: {"traceEvents": [{"name": ...}]}).
std::set<std::string> operatorsIn(const std::string& tracePath) {
  const auto trace = nlohmann::json::parse(test::readFile(tracePath));
  std::set<std::string> names;
  for (const auto& e : trace.at("traceEvents")) {
    if (e.contains("name") && e["name"].is_string()) names.insert(e["name"].get<std::string>());
  }
  return names;
}

// The window's trace is written and its time is accounted for per lane: the training thread ran
// operators for part of the window, no lane was busy longer than the window lasted, and the
// profiled steps are still step events.
TEST(Profile, AWindowOfStepsWritesATraceAndSaysWhereItsTimeWent) {
  test::TempDir dir;
  const std::string trace = dir.file("trace.json");
  auto r = test::runCommand(test::cohortBinary() + kRun + " --steps 8 --progress lines --profile " + trace +
                                " --profile-steps 3:5 --metrics " + dir.file("m.jsonl"),
                            120);
  ASSERT_EQ(r.exitCode, 0) << r.output;
  EXPECT_NE(r.output.find("profile of 3 step(s)"), std::string::npos) << r.output;
  // LibTorch's CUDA build without a GPU: Kineto's "ERROR: ... gpuGetDeviceCount failed" is kept quiet.
  EXPECT_EQ(r.output.find("gpuGetDeviceCount"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find(trace), std::string::npos) << r.output;
  const auto ops = operatorsIn(trace);
  EXPECT_TRUE(ops.count("aten::addmm") > 0) << "the mlp's linear layers are not in the trace";
  EXPECT_TRUE(ops.count("aten::mm") > 0) << "their backward is not in the trace";
  const auto lanes = test::events(dir.file("m.jsonl"), "profile");
  ASSERT_FALSE(lanes.empty()) << r.output;
  double busiestCpu = 0;
  for (const auto& lane : lanes) {
    EXPECT_EQ(lane["steps"], 3) << lane.dump();
    EXPECT_EQ(lane["step"], 5) << lane.dump();
    EXPECT_EQ(lane["trace"], trace) << lane.dump();
    EXPECT_GT(lane["events"].get<int64_t>(), 0) << lane.dump();
    EXPECT_LE(lane["busy_s"].get<double>(), lane["window_s"].get<double>()) << lane.dump();
    if (lane["lane"].get<std::string>().rfind("cpu thread ", 0) == 0) {
      busiestCpu = std::max(busiestCpu, lane["busy_s"].get<double>());
    }
  }
  EXPECT_GT(busiestCpu, 0.0) << "no CPU thread was busy in the window";
  EXPECT_EQ(test::events(dir.file("m.jsonl"), "step").size(), 8u);
  EXPECT_GT(test::lastEvent(dir.file("m.jsonl"), "done")["samples_per_s"].get<double>(), 0.0);
}

// Several ranks: each writes its own trace, named by its rank.
TEST(Profile, EachRankWritesItsOwnTrace) {
  test::TempDir dir;
  auto r = test::runCommand(test::cohortBinary() + " launch -n 2 -- " + test::cohortBinary() + kRun +
                                " --strategy allreduce --steps 5 --progress off --profile " + dir.file("t.json") +
                                " --profile-steps 2:3",
                            120);
  ASSERT_EQ(r.exitCode, 0) << r.output;
  for (int rank : {0, 1}) {
    const std::string trace = dir.file("t.rank" + std::to_string(rank) + ".json");
    ASSERT_TRUE(std::filesystem::exists(trace)) << trace << "\n" << r.output;
    EXPECT_TRUE(operatorsIn(trace).count("aten::addmm") > 0) << trace;
  }
  EXPECT_FALSE(std::filesystem::exists(dir.file("t.json")));

  // A directory is refused with several ranks too (its rank paths, DIR.rankN beside it, are files).
  auto aDirectory = test::runCommand(test::cohortBinary() + " launch -n 2 -- " + test::cohortBinary() + kRun +
                                         " --strategy allreduce --steps 5 --progress off --profile " + dir.path(),
                                     120);
  EXPECT_NE(aDirectory.exitCode, 0) << aDirectory.output;
  EXPECT_NE(aDirectory.output.find("--profile " + dir.path() + ": is a directory"), std::string::npos)
      << aDirectory.output;
  EXPECT_FALSE(std::filesystem::exists(dir.path() + ".rank0")) << aDirectory.output;
}

// A run resumed inside the window profiles the window's steps it runs.
TEST(Profile, ARunResumedInsideTheWindowProfilesTheRestOfIt) {
  test::TempDir dir;
  const std::string common =
      test::cohortBinary() + kRun + " --progress off --checkpoint-every 4 --checkpoint-dir " + dir.path();
  auto first = test::runCommand(common + " --steps 4");
  ASSERT_EQ(first.exitCode, 0) << first.output;
  auto resumed = test::runCommand(common + " --steps 8 --resume --profile " + dir.file("t.json") +
                                  " --profile-steps 3:6 --metrics " + dir.file("m.jsonl"));
  ASSERT_EQ(resumed.exitCode, 0) << resumed.output;
  const auto lanes = test::events(dir.file("m.jsonl"), "profile");
  ASSERT_FALSE(lanes.empty()) << resumed.output;
  EXPECT_EQ(lanes[0]["steps"], 2) << lanes[0].dump();  // steps 5 and 6
  EXPECT_EQ(lanes[0]["step"], 6) << lanes[0].dump();
}

// Bad input: one line naming the problem and the fix, before any step runs; a window the run
// never reaches is said at the end.
TEST(Profile, BadWindowsAndPathsAreNamed) {
  test::TempDir dir;
  auto backwards = test::runCommand(test::cohortBinary() + kRun + " --steps 4 --profile " + dir.file("t.json") +
                                    " --profile-steps 5:3");
  EXPECT_EQ(backwards.exitCode, 2) << backwards.output;
  EXPECT_NE(backwards.output.find("--profile-steps 5:3: expected FIRST:LAST"), std::string::npos) << backwards.output;

  auto noDir = test::runCommand(test::cohortBinary() + kRun + " --steps 4 --profile " + dir.file("nowhere/t.json"));
  EXPECT_NE(noDir.exitCode, 0) << noDir.output;
  EXPECT_NE(noDir.output.find("does not exist; create it first"), std::string::npos) << noDir.output;

  // A directory: Kineto would write DIR.tmp beside it and fail to rename it, logging only.
  auto aDirectory = test::runCommand(test::cohortBinary() + kRun + " --steps 4 --profile " + dir.path());
  EXPECT_EQ(aDirectory.exitCode, 2) << aDirectory.output;
  EXPECT_NE(aDirectory.output.find("--profile " + dir.path() + ": is a directory; name the file to write in it"),
            std::string::npos)
      << aDirectory.output;
  EXPECT_FALSE(std::filesystem::exists(dir.path() + ".tmp"));

  auto tooShort = test::runCommand(test::cohortBinary() + kRun + " --steps 4 --progress off --profile " +
                                   dir.file("t.json") + " --profile-steps 6:10");
  EXPECT_EQ(tooShort.exitCode, 0) << tooShort.output;
  EXPECT_NE(tooShort.output.find("no step of this run (steps 1 to 4) is in --profile-steps 6:10: no trace was written"),
            std::string::npos)
      << tooShort.output;
  EXPECT_FALSE(std::filesystem::exists(dir.file("t.json")));
}

}  // namespace
}  // namespace cohort::profile_test
