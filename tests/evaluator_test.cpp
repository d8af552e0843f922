// The evaluator task, `cohort ensemble` and `cohort quantize`, as separate processes.
#include "test_util.h"

#include <filesystem>
#include <map>

namespace cohort::evaluator_test {
namespace {

std::string train() { return test::cohortBinary() + " train"; }

using test::events;

std::map<int64_t, int> evaluatedCounts(const std::string& record) {
  std::map<int64_t, int> counts;
  for (const auto& e : events(record, "eval")) ++counts[e["step"].get<int64_t>()];
  return counts;
}

void expectOneLineError(const test::CommandResult& r, const std::string& needle) {
  EXPECT_NE(r.exitCode, 0) << r.output;
  const auto lines = test::lines(r.output);
  ASSERT_EQ(lines.size(), 1u) << r.output;
  EXPECT_EQ(lines[0].rfind("cohort: error: ", 0), 0u) << lines[0];
  EXPECT_NE(lines[0].find(needle), std::string::npos) << "expected '" << needle << "' in: " << lines[0];
}

const std::string kSmallRun = " --data synthetic:1200 --model mlp --validation 100 --progress off";

TEST(Evaluator, EvaluatesEveryCheckpointOnceAndEndsWithTheJob) {
  test::TempDir dir;
  const std::string ckpt = dir.file("ckpt");
  const std::string command =
      test::cohortBinary() + " launch -n 2 --evaluator -- " + train() + " --strategy allreduce" + kSmallRun +
      " --steps 40 --eval-every 10 --device cpu --checkpoint-dir " + ckpt + " --metrics " + dir.file("m.jsonl");
  auto run = test::runCommand(command, 180);
  ASSERT_EQ(run.exitCode, 0) << run.output;
  const std::string record = ckpt + "/evaluator-0.jsonl";
  const std::map<int64_t, int> counts = evaluatedCounts(record);
  EXPECT_EQ(counts, (std::map<int64_t, int>{{10, 1}, {20, 1}, {30, 1}, {40, 1}})) << test::readFile(record);
  for (const auto& e : events(record, "eval")) {
    EXPECT_TRUE(e.contains("val_accuracy") && e.contains("val_loss") && e.contains("accuracy")) << e.dump();
    EXPECT_EQ(e["device"], "cpu") << e.dump();  // the workers' --device
  }
  const auto done = events(record, "done");
  ASSERT_EQ(done.size(), 1u);
  EXPECT_EQ(done[0]["final_step"], 40);
  // The chief did not pause for evaluation: its only eval event is the final one, after training.
  const auto chiefEvals = events(dir.file("m.jsonl"), "eval");
  ASSERT_EQ(chiefEvals.size(), 1u);
  EXPECT_EQ(chiefEvals[0]["step"], 40);
  // ...and it is the same model the evaluator read at step 40.
  const auto evaluatorFinal = events(record, "eval").back();
  EXPECT_DOUBLE_EQ(chiefEvals[0]["accuracy"].get<double>(), evaluatorFinal["accuracy"].get<double>());
  EXPECT_DOUBLE_EQ(chiefEvals[0]["val_accuracy"].get<double>(), evaluatorFinal["val_accuracy"].get<double>());
  EXPECT_NE(run.output.find("[evaluator]"), std::string::npos);
}

// TensorFlow keeps the evaluator out of TF_CONFIG's cluster (so does Kubeflow's TFJob): such an
// evaluator was refused; now it runs, and stops on the end-of-training marker, which a chief that
// knows of no evaluator writes too.
TEST(Evaluator, OneTheClusterDoesNotListEvaluatesAndEnds) {
  test::TempDir dir;
  const std::string ckpt = dir.file("ckpt");
  const std::string cluster = R"({"cluster": {"chief": ["127.0.0.1:0"]}, )";
  const std::string flags = kSmallRun + " --steps 20 --checkpoint-every 10 --checkpoint-dir " + ckpt;
  auto chief = test::runCommand("env COHORT_JOB_ID=unlisted TF_CONFIG='" + cluster +
                                    R"("task": {"type": "chief", "index": 0}}' )" + train() + flags,
                                180);
  ASSERT_EQ(chief.exitCode, 0) << chief.output;
  auto evaluator = test::runCommand("env COHORT_JOB_ID=unlisted TF_CONFIG='" + cluster +
                                        R"("task": {"type": "evaluator", "index": 0}}' )" + train() + flags +
                                        " --evaluator-timeout 60",
                                    180);
  ASSERT_EQ(evaluator.exitCode, 0) << evaluator.output;
  const std::map<int64_t, int> counts = evaluatedCounts(ckpt + "/evaluator-0.jsonl");
  EXPECT_EQ(counts, (std::map<int64_t, int>{{10, 1}, {20, 1}})) << evaluator.output;
}

// A resumed run is a new job: its evaluator does not take the first run's end-of-training marker
// (step 20) for its own, which made it stop at once and left the resumed run's checkpoints
// unevaluated. The chief is slowed so that the evaluator would surely read the old marker first.
TEST(Evaluator, AResumedRunsEvaluatorEvaluatesItsCheckpoints) {
  test::TempDir dir;
  const std::string ckpt = dir.file("ckpt");
  const std::string command = test::cohortBinary() + " launch -n 1 --evaluator -- " + train() + kSmallRun +
                              " --eval-every 10 --device cpu --checkpoint-dir " + ckpt;
  auto first = test::runCommand(command + " --steps 20", 180);
  ASSERT_EQ(first.exitCode, 0) << first.output;
  auto resumed = test::runCommand(command + " --steps 40 --resume --test-slow-worker 0:0.05", 180);
  ASSERT_EQ(resumed.exitCode, 0) << resumed.output;
  const std::map<int64_t, int> counts = evaluatedCounts(ckpt + "/evaluator-0.jsonl");
  EXPECT_EQ(counts, (std::map<int64_t, int>{{10, 1}, {20, 1}, {30, 1}, {40, 1}}))
      << test::readFile(ckpt + "/evaluator-0.jsonl") << resumed.output;
  EXPECT_NE(resumed.output.find("training ended at step 40"), std::string::npos) << resumed.output;
}

// Under cohort launch the evaluator SIGKILLs itself right after recording its second checkpoint
// (--test-kill-evaluator-after 2, a kill at a known point instead of a timed one); the launcher
// starts it again, training goes on, and the restarted evaluator picks up after step 20: every
// checkpoint is recorded exactly once and the job ends with 0.
TEST(Evaluator, UnderLaunchIsRestartedAfterAKillAndEvaluatesEachCheckpointOnce) {
  test::TempDir dir;
  const std::string ckpt = dir.file("ckpt");
  const std::string command = test::cohortBinary() + " launch -n 2 --evaluator -- " + train() +
                              " --strategy allreduce" + kSmallRun + " --steps 60 --eval-every 10 --threads 1 --checkpoint-dir " + ckpt +
                              " --metrics " + dir.file("m.jsonl") + " --test-kill-evaluator-after 2";
  auto run = test::runCommand(command, 240);
  ASSERT_EQ(run.exitCode, 0) << run.output;
  EXPECT_NE(run.output.find("cohort launch: evaluator was killed by signal 9 (SIGKILL); starting it again, it goes "
                            "on from its record (evaluator restart 1 of 3); the workers go on"),
            std::string::npos)
      << run.output;
  EXPECT_NE(run.output.find("[evaluator] cohort: evaluator 0: 2 checkpoints already recorded"), std::string::npos)
      << run.output;
  const std::string record = ckpt + "/evaluator-0.jsonl";
  std::map<int64_t, int> expected;
  for (int step = 10; step <= 60; step += 10) expected[step] = 1;
  EXPECT_EQ(evaluatedCounts(record), expected) << test::readFile(record);
  const auto done = events(record, "done");
  ASSERT_EQ(done.size(), 1u) << test::readFile(record);
  EXPECT_EQ(done[0]["final_step"], 60);
  EXPECT_EQ(done[0]["evaluated"], 6);
  EXPECT_EQ(done[0]["evaluated_by_this_process"], 4);  // the other 2 were the first process's
  // Training was not stopped: the chief ran every step and made its final evaluation.
  const auto chiefDone = test::lastEvent(dir.file("m.jsonl"), "done");
  ASSERT_FALSE(chiefDone.is_null()) << run.output;
  EXPECT_EQ(chiefDone["steps"], 60);
}

// The same by hand, in a TF_CONFIG job of one chief and one evaluator (no launcher): the first
// evaluator dies by SIGKILL after its second record, a second one is started in its place.
TEST(Evaluator, ToleratesAKillAndARestart) {
  test::TempDir dir;
  const std::string ckpt = dir.file("ckpt");
  std::filesystem::create_directories(ckpt);
  // One worker: no rendezvous store, so the chief's port is 0; the evaluator listens on nothing.
  const std::string cluster = "{\"cluster\":{\"chief\":[\"127.0.0.1:0\"],\"evaluator\":[\"127.0.0.1:0\"]},";
  auto tf = [&](const std::string& type) {
    return "TF_CONFIG='" + cluster + "\"task\":{\"type\":\"" + type + "\",\"index\":0}}' ";
  };
  const std::string flags = kSmallRun + " --steps 60 --eval-every 10 --threads 1 --checkpoint-dir " + ckpt +
                            " --test-kill-evaluator-after 2";
  const std::string record = ckpt + "/evaluator-0.jsonl";
  const std::string script =
      tf("chief") + train() + flags + " > " + dir.file("chief.log") + " 2>&1 &\nchief=$!\n" + tf("evaluator") +
      train() + flags + " > " + dir.file("ev1.log") + " 2>&1\nfirst=$?\n" + tf("evaluator") + train() + flags +
      " > " + dir.file("ev2.log") + " 2>&1\ne=$?\nwait $chief\nc=$?\necho chief=$c first=$first evaluator=$e\n";
  test::writeFile(dir.file("run.sh"), script);
  auto r = test::runCommand("bash " + dir.file("run.sh"), 240);
  ASSERT_EQ(r.exitCode, 0) << r.output;
  EXPECT_NE(r.output.find("chief=0 first=137 evaluator=0"), std::string::npos)
      << r.output << test::readFile(dir.file("chief.log")) << test::readFile(dir.file("ev2.log"));
  std::map<int64_t, int> expected;
  for (int step = 10; step <= 60; step += 10) expected[step] = 1;
  EXPECT_EQ(evaluatedCounts(record), expected) << test::readFile(record);
  EXPECT_NE(test::readFile(dir.file("ev2.log")).find("2 checkpoints already recorded"), std::string::npos);
  const auto done = events(record, "done");
  ASSERT_EQ(done.size(), 1u);
  EXPECT_EQ(done[0]["evaluated_by_this_process"].get<int64_t>(), 4);
}

// Tensor parallelism checkpoints each way in its own directory (way-0/, way-1/): its chief was
// let through with an evaluator task, which waited out its --evaluator-timeout for a checkpoint
// in --checkpoint-dir itself and failed. Refused before training, by the workers and the evaluator.
TEST(Evaluator, UnderTensorParallelismIsRefused) {
  test::TempDir dir;
  auto r = test::runCommand(test::cohortBinary() + " launch -n 2 --evaluator -- " + train() +
                                " --strategy tensor --ways 2" + kSmallRun + " --steps 20 --checkpoint-every 10 " +
                                "--timeout 30 --evaluator-timeout 100 --checkpoint-dir " + dir.file("ckpt"),
                            120);
  EXPECT_NE(r.exitCode, 0) << r.output;
  EXPECT_NE(r.output.find("--strategy tensor does not write whole-model checkpoints, which an evaluator task reads"),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("[evaluator] cohort: error: an evaluator task reads whole-model checkpoints, which "
                          "--strategy tensor does not write (it checkpoints per way)"),
            std::string::npos)
      << r.output;
  EXPECT_EQ(r.output.find("no new checkpoint"), std::string::npos) << r.output;
}

// --max-seconds stops a run whose evaluations are the evaluator's: it never acted there (the
// chief's evaluation points only wrote checkpoints).
TEST(Evaluator, MaxSecondsStopsTheRunItEvaluates) {
  test::TempDir dir;
  const std::string ckpt = dir.file("ckpt");
  auto r = test::runCommand(test::cohortBinary() + " launch -n 1 --evaluator -- " + train() + kSmallRun +
                                " --steps 100000 --eval-every 20 --max-seconds 1 --test-slow-worker 0:0.01 "
                                "--device cpu --checkpoint-dir " +
                                ckpt + " --metrics " + dir.file("m.jsonl"),
                            180);
  ASSERT_EQ(r.exitCode, 0) << r.output;
  const auto done = events(dir.file("m.jsonl"), "done");
  ASSERT_EQ(done.size(), 1u) << r.output;
  const int64_t steps = done[0]["steps"].get<int64_t>();
  EXPECT_LT(steps, 100000);
  EXPECT_EQ(steps % 20, 0) << "it stops at an evaluation point";
  const auto record = events(ckpt + "/evaluator-0.jsonl", "done");
  ASSERT_EQ(record.size(), 1u) << r.output;
  EXPECT_EQ(record[0]["final_step"].get<int64_t>(), steps);
}

TEST(Evaluator, WithoutACheckpointDirectoryIsAOneLineError) {
  const std::string tf = "env TF_CONFIG='{\"cluster\":{\"chief\":[\"127.0.0.1:0\"],"
                         "\"evaluator\":[\"127.0.0.1:0\"]},\"task\":{\"type\":\"evaluator\",\"index\":0}}' ";
  expectOneLineError(test::runCommand(tf + train() + kSmallRun + " --steps 5", 60), "--checkpoint-dir");
}

TEST(Evaluator, AnEvaluatorTimeoutThatIsNoWaitIsAOneLineError) {
  const std::string tf =
      "env TF_CONFIG='{\"cluster\":{\"chief\":[\"127.0.0.1:0\"],"
      "\"evaluator\":[\"127.0.0.1:0\"]},\"task\":{\"type\":\"evaluator\",\"index\":0}}' ";
  for (const std::string value : {"0", "-5", "nan"}) {
    expectOneLineError(
        test::runCommand(
            tf + train() + kSmallRun + " --steps 5 --checkpoint-dir /tmp/none " + "--evaluator-timeout " + value, 60),
        "--evaluator-timeout must be a number of seconds in (0, 604800]");
  }
}

// An IDX data set of `classes` classes, n examples of 28x28, labels 0..classes-1 in turn.
void writeIdx(const std::string& dir, int classes, int n) {
  auto header = [](uint8_t type, std::vector<uint32_t> dims) {
    std::string h{'\0', '\0', char(type), char(dims.size())};
    for (uint32_t d : dims) {
      for (int k = 3; k >= 0; --k) h.push_back(char((d >> (8 * k)) & 0xFF));
    }
    return h;
  };
  for (const char* prefix : {"train", "t10k"}) {
    std::string images = header(0x08, {uint32_t(n), 28, 28});
    std::string labels = header(0x08, {uint32_t(n)});
    for (int i = 0; i < n; ++i) {
      const int label = i % classes;
      for (int p = 0; p < 28 * 28; ++p) images.push_back(char(p % classes == label ? 200 : 10));
      labels.push_back(char(label));
    }
    // IDX magic: 0x00 0x00 type dims; images are 3-d, labels 1-d.
    test::writeFile(dir + "/" + prefix + "-images-idx3-ubyte", images);
    test::writeFile(dir + "/" + prefix + "-labels-idx1-ubyte", labels);
  }
}

TEST(Ensemble, OfIdenticalModelsEqualsTheModel) {
  test::TempDir dir;
  auto r = test::runCommand(train() + kSmallRun + " --steps 30 --threads 1 --save-model " + dir.file("a.pt"), 120);
  ASSERT_EQ(r.exitCode, 0) << r.output;
  r = test::runCommand(
      test::cohortBinary() + " ensemble " + dir.file("a.pt") + " " + dir.file("a.pt") + " " + dir.file("a.pt") +
          " --data synthetic:1200 --validation 100 --threads 1 --device cpu --metrics " + dir.file("e.jsonl"),
      120);
  ASSERT_EQ(r.exitCode, 0) << r.output;
  const auto models = events(dir.file("e.jsonl"), "model");
  const auto ensemble = events(dir.file("e.jsonl"), "ensemble");
  ASSERT_EQ(models.size(), 3u);
  ASSERT_EQ(ensemble.size(), 1u);
  for (const char* key : {"val_accuracy", "test_accuracy", "test_macro_f1"}) {
    EXPECT_DOUBLE_EQ(ensemble[0][key].get<double>(), models[0][key].get<double>()) << key;
  }
  EXPECT_NEAR(ensemble[0]["test_loss"].get<double>(), models[0]["test_loss"].get<double>(), 1e-5);
  EXPECT_NEAR(ensemble[0]["val_loss"].get<double>(), models[0]["val_loss"].get<double>(), 1e-5);
  EXPECT_GT(models[0]["test_accuracy"].get<double>(), 0.3);  // it did learn something: the check has teeth
  EXPECT_EQ(ensemble[0]["device"], "cpu");
  EXPECT_NE(r.output.find("ensemble"), std::string::npos);
}

// A device this machine does not have ends the command before any model is read (cuda:99: no
// machine has it, so the test means the same with or without a GPU).
TEST(Ensemble, ADeviceThatIsNotThereIsAOneLineError) {
  test::TempDir dir;
  expectOneLineError(
      test::runCommand(
          test::cohortBinary() + " ensemble " + dir.file("absent.pt") + " --data synthetic:600 --device cuda:99", 60),
      "device \"cuda:99\"");
}

TEST(Ensemble, RefusesModelsWithDifferentOutputs) {
  test::TempDir dir;
  const std::string five = dir.file("five");
  std::filesystem::create_directories(five);
  writeIdx(five, 5, 60);
  // 60 examples: a batch of 16, as the default of 64 is larger than the data set and refused.
  auto r = test::runCommand(train() + " --data mnist:" + five + " --model mlp --batch 16 --steps 2 --progress off" +
                                " --save-model " + dir.file("five.pt"),
                            120);
  ASSERT_EQ(r.exitCode, 0) << r.output;
  r = test::runCommand(train() + " --data synthetic:600 --model mlp --steps 2 --progress off --save-model " +
                           dir.file("ten.pt"),
                       120);
  ASSERT_EQ(r.exitCode, 0) << r.output;
  expectOneLineError(test::runCommand(test::cohortBinary() + " ensemble " + dir.file("ten.pt") + " " +
                                          dir.file("five.pt") + " --data synthetic:600",
                                      60),
                     "has 5 outputs but");
}

TEST(Quantize, RoundTripKeepsAccuracyAndShrinksTheFile) {
  test::TempDir dir;
  auto r = test::runCommand(train() + kSmallRun + " --steps 60 --threads 1 --save-model " + dir.file("f.pt"), 120);
  ASSERT_EQ(r.exitCode, 0) << r.output;
  r = test::runCommand(test::cohortBinary() + " quantize " + dir.file("f.pt") + " --out " + dir.file("q.pt") +
                           " --data synthetic:1200 --repeat 1 --threads 1 --metrics " + dir.file("q.jsonl"),
                       120);
  ASSERT_EQ(r.exitCode, 0) << r.output;
  const auto q = test::lastEvent(dir.file("q.jsonl"), "quantize");
  ASSERT_FALSE(q.is_null()) << r.output;
  EXPECT_EQ(q["layers_quantized"], 3);
  EXPECT_LT(q["size_ratio"].get<double>(), 0.3);
  EXPECT_NEAR(q["int8_test_accuracy"].get<double>(), q["float_test_accuracy"].get<double>(), 0.02);
  EXPECT_NEAR(q["dequantized_test_accuracy"].get<double>(), q["float_test_accuracy"].get<double>(), 0.02);
  // The 8-bit file reads back as a model (its int8 weights dequantized) wherever a model is taken.
  r = test::runCommand(test::cohortBinary() + " ensemble " + dir.file("q.pt") +
                           " --data synthetic:1200 --threads 1 --device cpu --metrics " + dir.file("e.jsonl"),
                       120);
  ASSERT_EQ(r.exitCode, 0) << r.output;
  EXPECT_DOUBLE_EQ(test::lastEvent(dir.file("e.jsonl"), "ensemble")["test_accuracy"].get<double>(),
                   q["dequantized_test_accuracy"].get<double>());
}

TEST(Quantize, RefusesAFileThatIsNotAModel) {
  test::TempDir dir;
  test::writeFile(dir.file("notes.pt"), "not a model at all\n");
  expectOneLineError(test::runCommand(test::cohortBinary() + " quantize " + dir.file("notes.pt") + " --out " +
                                          dir.file("q.pt") + " --data synthetic:600",
                                      60),
                     "not a model file");
}

// --out is checked before any work: the model itself (which the 8-bit file would replace), a
// directory, a directory that does not exist. The model file is left as it was.
TEST(Quantize, RefusesAnOutThatIsTheModelOrNoFile) {
  test::TempDir dir;
  auto r = test::runCommand(train() + kSmallRun + " --steps 2 --threads 1 --save-model " + dir.file("f.pt"), 120);
  ASSERT_EQ(r.exitCode, 0) << r.output;
  const std::string before = test::readFile(dir.file("f.pt"));
  const std::string quantize = test::cohortBinary() + " quantize " + dir.file("f.pt") + " --data synthetic:600 --out ";
  expectOneLineError(test::runCommand(quantize + dir.path() + "/./f.pt", 60),
                     "--out " + dir.path() + "/./f.pt is " + dir.file("f.pt") + ", the model to quantize");
  expectOneLineError(test::runCommand(quantize + dir.path(), 60), "--out " + dir.path() + ": is a directory");
  expectOneLineError(test::runCommand(quantize + dir.file("none/q.pt"), 60),
                     "--out " + dir.file("none/q.pt") + ": the directory " + dir.file("none") + " does not exist");
  EXPECT_TRUE(test::readFile(dir.file("f.pt")) == before) << "the model file changed";
}

}  // namespace
}  // namespace cohort::evaluator_test
