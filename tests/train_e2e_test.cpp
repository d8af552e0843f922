// End to end through the `cohort` binary on the real Fashion-MNIST.
#include <cohort/checkpoint.h>

#include <nlohmann/json.hpp>

#include "test_util.h"

namespace cohort::train_e2e_test {
namespace {

using test::lastEvent;

// The accuracy bound: mlp >= 0.80 after one epoch (momentum 0.9, lr 0.01, batch 64).
TEST(TrainE2E, MlpReaches80PercentInOneEpoch) {
  test::TempDir dir;
  auto r = test::runCommand(test::cohortBinary() +
                                " train --model mlp --data fashion-mnist --epochs 1 --batch 64 --lr 0.01"
                                " --optimizer momentum --momentum 0.9 --progress lines --metrics " +
                                dir.file("m.jsonl"),
                            300);
  ASSERT_EQ(r.exitCode, 0) << r.output;
  auto done = lastEvent(dir.file("m.jsonl"), "done");
  ASSERT_FALSE(done.is_null()) << r.output;
  EXPECT_EQ(done["steps"], 938);  // ceil(60000 / 64)
  EXPECT_GE(done["test_accuracy"].get<double>(), 0.80) << done.dump();
  EXPECT_GT(done["samples_per_s"].get<double>(), 0.0);
  // In a pipe, progress comes as lines, each naming the step.
  EXPECT_NE(r.output.find("step 938/938"), std::string::npos) << r.output;
}

TEST(TrainE2E, TorchScriptModelTrainsFromCpp) {
  test::TempDir dir;
  const std::string model = dir.file("net.pt");
  auto made = test::runCommand(test::python() + " " + test::sourceDir() + "/examples/make_torchscript.py " + model);
  ASSERT_EQ(made.exitCode, 0) << made.output;
  auto r = test::runCommand(test::cohortBinary() + " train --model " + model +
                                " --data fashion-mnist --steps 400 --progress off --metrics " + dir.file("m.jsonl"),
                            300);
  ASSERT_EQ(r.exitCode, 0) << r.output;
  auto done = lastEvent(dir.file("m.jsonl"), "done");
  EXPECT_GE(done["test_accuracy"].get<double>(), 0.75) << done.dump();
}

TEST(TrainE2E, KilledRunResumesFromItsCheckpoint) {
  test::TempDir dir;
  const std::string common = test::cohortBinary() +
                             " train --model mlp --data fashion-mnist --threads 1 --progress off"
                             " --checkpoint-every 50 --checkpoint-dir " + dir.path();
  // A run far too long to finish, killed with SIGKILL a few seconds in.
  auto first = test::runCommand("timeout -s KILL 5 " + common + " --steps 1000000", 60);
  EXPECT_EQ(first.exitCode, 128 + 9) << first.output;
  CheckpointStore store(dir.path());
  auto files = store.list();
  ASSERT_FALSE(files.empty()) << "no checkpoint written before the kill";
  const int64_t saved = files.front().step;
  EXPECT_EQ(saved % 50, 0);

  auto second = test::runCommand(common + " --steps " + std::to_string(saved + 30) + " --resume --metrics " +
                                     dir.file("b.jsonl"), 120);
  ASSERT_EQ(second.exitCode, 0) << second.output;
  EXPECT_NE(second.output.find("resumed from " + files.front().path), std::string::npos) << second.output;
  auto done = lastEvent(dir.file("b.jsonl"), "done");
  EXPECT_EQ(done["steps"], saved + 30);
  // Only the 30 steps after the checkpoint were trained again.
  int stepEvents = 0;
  for (const auto& line : test::lines(test::readFile(dir.file("b.jsonl")))) {
    if (nlohmann::json::parse(line)["event"] == "step") ++stepEvents;
  }
  EXPECT_EQ(stepEvents, 30);
}

}  // namespace
}  // namespace cohort::train_e2e_test
