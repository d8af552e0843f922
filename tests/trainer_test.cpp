#include "train/trainer.h"
#include "base/scheme.h"
#include "train/trainer_internal.h"
#include <cohort/checkpoint.h>
#include <cohort/error.h>
#include <cohort/models.h>

#include <nlohmann/json.hpp>

#include <torch/torch.h>

#include <algorithm>
#include <filesystem>
#include <limits>

#include "test_util.h"

namespace cohort::trainer_test {
namespace {

TrainOptions smallRun() {
  TrainOptions o;
  o.model = "mlp";
  o.data = "synthetic:640";
  o.batch = 16;
  o.threads = 1;
  o.seed = 3;
  o.progress = ProgressMode::kOff;
  o.optimizer = OptimizerKind::kMomentum;
  return o;
}

// Runs smallRun() for 5 steps with checkpoints in DIR and returns its options.
TrainOptions checkpointedRunOf5Steps(test::TempDir& dir) {
  TrainOptions o = smallRun();
  o.steps = 5;
  o.checkpointDir = dir.path();
  Trainer(o).run();
  return o;
}

std::vector<torch::Tensor> parametersOf(const Trainer& t) {
  std::vector<torch::Tensor> out;
  for (auto& p : t.model()->parameters()) out.push_back(p.detach().clone());
  return out;
}

void expectIdentical(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_TRUE(torch::equal(a[i], b[i])) << "parameter " << i << " differs by "
                                          << (a[i] - b[i]).abs().max().item<double>();
  }
}

TEST(Trainer, ResumeReachesTheSameParametersAsAnUninterruptedRun) {
  for (const char* optimizer : {"momentum", "adam"}) {
    // 40 steps cross an epoch boundary (640 / 16 = 40 steps per epoch... use 55 to cross it).
    TrainOptions full = smallRun();
    full.optimizer = *parseOptimizer(optimizer);
    full.steps = 55;
    Trainer uninterrupted(full);
    uninterrupted.run();

    test::TempDir dir;
    TrainOptions first = full;
    first.steps = 47;  // stops mid-epoch, checkpoint at the end
    first.checkpointDir = dir.path();
    Trainer(first).run();

    TrainOptions second = full;
    second.checkpointDir = dir.path();
    second.resume = true;
    Trainer resumed(second);
    TrainResult r = resumed.run();
    EXPECT_EQ(r.steps, 55);
    expectIdentical(parametersOf(uninterrupted), parametersOf(resumed));
  }
}

// Under --autocast fp16 the loss scale is training state: with a scaler that grows every 3 good
// steps, the scale climbs until a step overflows float16 and backs off, again and again, so a run
// resumed with a fresh scale would skip other steps than the uninterrupted one.
TEST(Trainer, ResumeUnderFloat16CarriesTheLossScale) {
  test::TempDir dir;
  // The done event's loss scale and skipped steps (counted from the run's first step).
  const auto scaleAtTheEnd = [](const std::string& metrics) {
    const nlohmann::json done = nlohmann::json::parse(test::lines(test::readFile(metrics)).back());
    return std::pair{done.at("loss_scale").get<double>(), done.at("skipped_steps").get<int64_t>()};
  };
  TrainOptions full = smallRun();
  full.strategy.autocast = c10::kHalf;
  full.strategy.scaler.growthInterval = 3;
  full.steps = 30;
  full.metricsPath = dir.file("full.jsonl");
  Trainer uninterrupted(full);
  uninterrupted.run();
  const auto [expectedScale, skipped] = scaleAtTheEnd(full.metricsPath);
  ASSERT_GT(skipped, 1) << "too few steps overflowed: the test shows nothing";

  TrainOptions first = full;
  first.steps = 22;
  first.checkpointDir = dir.file("ckpt");
  first.metricsPath = dir.file("first.jsonl");
  Trainer(first).run();
  const int64_t skippedBefore = scaleAtTheEnd(first.metricsPath).second;
  TrainOptions second = first;
  second.steps = full.steps;
  second.resume = true;
  second.metricsPath = dir.file("second.jsonl");
  Trainer resumed(second);
  resumed.run();
  const auto [scale, skippedAfter] = scaleAtTheEnd(second.metricsPath);
  EXPECT_EQ(scale, expectedScale);
  EXPECT_EQ(skippedAfter, skipped) << skippedBefore << " skipped before the checkpoint";
  expectIdentical(parametersOf(uninterrupted), parametersOf(resumed));
}

TEST(Trainer, ResumeSkipsACorruptCheckpoint) {
  test::TempDir dir;
  TrainOptions o = smallRun();
  o.steps = 20;
  o.checkpointEvery = 10;
  o.checkpointDir = dir.path();
  Trainer(o).run();
  CheckpointStore store(dir.path());
  auto files = store.list();
  ASSERT_EQ(files.size(), 2u);  // steps 10 and 20
  std::string bytes = test::readFile(files[0].path);
  bytes[bytes.size() / 2] ^= 0x11;
  test::writeFile(files[0].path, bytes);

  // Resuming now starts from step 10; training to 20 must give the uninterrupted result.
  TrainOptions again = o;
  again.resume = true;
  again.checkpointEvery = 0;
  testing::internal::CaptureStderr();
  Trainer resumed(again);
  const std::string err = testing::internal::GetCapturedStderr();
  EXPECT_NE(err.find(files[0].path), std::string::npos) << err;
  EXPECT_NE(err.find("resumed from " + files[1].path), std::string::npos) << err;

  TrainOptions plain = smallRun();
  plain.steps = 20;
  Trainer reference(plain);
  reference.run();
  resumed.run();
  expectIdentical(parametersOf(reference), parametersOf(resumed));
}

// A stray ckpt-<20 digits>.ckpt beside a good checkpoint: a warning naming it, and the run resumes
// from the good one.
TEST(Trainer, ResumeSkipsAFileWhoseStepIsBeyondInt64) {
  test::TempDir dir;
  TrainOptions o = checkpointedRunOf5Steps(dir);
  const std::string stray = dir.file("ckpt-99999999999999999999.ckpt");
  test::writeFile(stray, "stray");
  TrainOptions again = o;
  again.resume = true;
  testing::internal::CaptureStderr();
  try {
    Trainer resumed(again);
  } catch (const std::exception& e) {
    ADD_FAILURE() << e.what();
  }
  const std::string err = testing::internal::GetCapturedStderr();
  EXPECT_NE(err.find("cohort: warning: " + stray + ": not a checkpoint cohort wrote"), std::string::npos) << err;
  EXPECT_NE(err.find("resumed from " + dir.file("ckpt-0000000005.ckpt")), std::string::npos) << err;
}

// A checkpoint whose data was damaged before its checksum was made (here: the archive's code
// indented wrongly, which TorchScript's reader refuses with an exception of its own): one error
// naming the file.
TEST(Trainer, ResumeNamesACheckpointWhoseDataIsCorruptUnderAValidChecksum) {
  test::TempDir dir;
  TrainOptions o = checkpointedRunOf5Steps(dir);
  CheckpointStore store(dir.path());
  std::vector<uint8_t> payload = CheckpointStore::readVerified(store.list()[0].path);
  const std::string code = "\n  __buffers__";
  const auto at = std::search(payload.begin(), payload.end(), code.begin(), code.end());
  ASSERT_NE(at, payload.end());
  at[2] = 'u';
  const std::string path = store.save(6, payload);  // a valid checksum of the damaged data
  TrainOptions again = o;
  again.resume = true;
  try {
    Trainer t(again);
    FAIL() << "resumed from damaged data";
  } catch (const IoError& e) {
    EXPECT_NE(std::string(e.what()).find(path + ": checkpoint payload is unreadable"), std::string::npos) << e.what();
  } catch (const std::exception& e) {
    FAIL() << "not an IoError naming the file: " << e.what();
  }
}

TEST(Trainer, ResumeRefusesACheckpointOfAnotherRun) {
  test::TempDir dir;
  TrainOptions o = checkpointedRunOf5Steps(dir);
  TrainOptions other = o;
  other.batch = 32;
  other.resume = true;
  try {
    Trainer t(other);
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("checkpoint is from a different run"), std::string::npos) << e.what();
  }
}

TEST(Trainer, MetricsHaveStepEvalAndDoneEvents) {
  test::TempDir dir;
  TrainOptions o = smallRun();
  o.steps = 12;
  o.evalEvery = 5;
  o.metricsPath = dir.file("m.jsonl");
  TrainResult r = Trainer(o).run();
  auto lines = test::lines(test::readFile(o.metricsPath));
  int steps = 0, evals = 0, done = 0;
  for (const auto& line : lines) {
    auto j = nlohmann::json::parse(line);
    const std::string event = j["event"];
    if (event == "step") {
      ++steps;
      EXPECT_EQ(j["samples"], 16);
    } else if (event == "eval") {
      ++evals;
      EXPECT_GE(j["accuracy"].get<double>(), 0.0);
    } else if (event == "done") {
      ++done;
      EXPECT_EQ(j["steps"], 12);
      EXPECT_GT(j["samples_per_s"].get<double>(), 0.0);
      EXPECT_DOUBLE_EQ(j["test_accuracy"].get<double>(), r.testAccuracy);
      EXPECT_GT(j["wall_s"].get<double>(), 0.0);
    }
  }
  EXPECT_EQ(steps, 12);
  EXPECT_EQ(evals, 3);  // at steps 5, 10 and the end
  EXPECT_EQ(done, 1);
  EXPECT_EQ(nlohmann::json::parse(lines.back())["event"], "done");
}

// A run resumed from step 5 after it reached step 7: the metrics held steps 6 and 7 twice and two
// done events. Every step is there once, and the one done event is the resumed run's.
TEST(Trainer, ResumeKeepsEveryStepOnceInTheMetrics) {
  test::TempDir dir;
  TrainOptions o = smallRun();
  o.steps = 7;
  o.checkpointEvery = 5;
  o.evalEvery = 3;
  o.checkpointDir = dir.file("ckpt");
  o.metricsPath = dir.file("m.jsonl");
  Trainer(o).run();
  std::filesystem::remove(dir.file("ckpt/ckpt-0000000007.ckpt"));  // as if it crashed after step 7
  test::writeFile(o.metricsPath, test::readFile(o.metricsPath) + "{\"event\":\"step\",\"st");  // cut off by a kill
  o.steps = 10;
  o.resume = true;
  testing::internal::CaptureStderr();
  Trainer(o).run();
  const std::string err = testing::internal::GetCapturedStderr();
  // Steps 6 and 7, the evals at 6 and at the end (7), the done event and the cut-off line.
  EXPECT_NE(err.find("--metrics " + o.metricsPath + ": 6 lines past step 5 dropped"), std::string::npos) << err;
  std::vector<int64_t> steps, evals;
  int done = 0;
  for (const auto& line : test::lines(test::readFile(o.metricsPath))) {
    const auto j = nlohmann::json::parse(line);
    if (j["event"] == "step") steps.push_back(j["step"]);
    if (j["event"] == "eval") evals.push_back(j["step"]);
    if (j["event"] == "done") ++done;
  }
  EXPECT_EQ(steps, (std::vector<int64_t>{1, 2, 3, 4, 5, 6, 7, 8, 9, 10}));
  EXPECT_EQ(evals, (std::vector<int64_t>{3, 6, 9, 10}));
  EXPECT_EQ(done, 1);
}

// The epoch of an eval event is its last step's: the run's end after epoch 1's last step was
// labelled epoch 2, which does not exist.
TEST(Trainer, AnEvalAtAnEpochsEndCarriesThatEpoch) {
  test::TempDir dir;
  TrainOptions o = smallRun();
  o.batch = 64;  // 10 steps per epoch of 640
  o.epochs = 2;
  o.evalEvery = 10;
  o.metricsPath = dir.file("m.jsonl");
  Trainer(o).run();
  std::vector<std::pair<int64_t, int64_t>> evals;  // (step, epoch)
  for (const auto& line : test::lines(test::readFile(o.metricsPath))) {
    const auto j = nlohmann::json::parse(line);
    if (j["event"] == "eval") evals.emplace_back(j["step"], j["epoch"]);
  }
  EXPECT_EQ(evals, (std::vector<std::pair<int64_t, int64_t>>{{10, 0}, {20, 1}}));
}

// A resumed run's clock goes on from its checkpoint's: --max-seconds and wall_s counted from the
// resumed process's start, so a run restarted after a kill had its whole time budget again.
TEST(Trainer, AResumedRunsClockGoesOnFromItsCheckpoint) {
  test::TempDir dir;
  TrainOptions o = smallRun();
  o.steps = 5;
  o.checkpointDir = dir.path();
  o.strategy.slowRank = 0;  // each step sleeps 0.3 s: the 5 steps take at least 1.5 s
  o.strategy.slowSeconds = 0.3;
  Trainer(o).run();
  TrainOptions again = smallRun();
  again.checkpointDir = dir.path();
  again.resume = true;
  again.steps = 40;
  again.evalEvery = 1;
  again.maxSeconds = 1.0;  // spent before the resume: the first evaluation stops the run
  again.metricsPath = dir.file("resumed.jsonl");
  const TrainResult r = Trainer(again).run();
  EXPECT_EQ(r.steps, 6);
  EXPECT_GE(r.wallSeconds, 1.5);
  const std::string metrics = test::readFile(again.metricsPath);
  const size_t step6 = metrics.find("\"step\":6,");
  ASSERT_NE(step6, std::string::npos) << metrics;
  const size_t wall = metrics.find("\"wall_s\":", step6);
  ASSERT_NE(wall, std::string::npos) << metrics;
  EXPECT_GE(std::stod(metrics.substr(wall + 9)), 1.5) << metrics;
}

// --momentum on --resume applies, as --lr does: LibTorch's load put the checkpoint's back silently.
TEST(Trainer, ResumeAppliesTheRunsMomentum) {
  // Steps 6..10 resumed with `momentum` from 5 steps at momentum 0.9; the parameters after them.
  const auto resumedWith = [](double momentum, std::string& err) {
    test::TempDir dir;
    TrainOptions o = checkpointedRunOf5Steps(dir);
    o.steps = 10;
    o.resume = true;
    o.momentum = momentum;
    testing::internal::CaptureStderr();
    Trainer t(o);
    err = testing::internal::GetCapturedStderr();
    t.run();
    return parametersOf(t);
  };
  std::string said, saidNothing;
  const auto without = resumedWith(0.0, said);
  const auto with = resumedWith(0.9, saidNothing);
  EXPECT_NE(said.find("the checkpoint's momentum was 0.9; this run's --momentum 0 applies"), std::string::npos) << said;
  EXPECT_EQ(saidNothing.find("momentum"), std::string::npos) << saidNothing;
  ASSERT_EQ(without.size(), with.size());
  EXPECT_FALSE(torch::equal(without[0], with[0])) << "--momentum 0 on --resume trained with the checkpoint's 0.9";
}

TEST(Trainer, TargetAccuracyStopsEarly) {
  TrainOptions o = smallRun();
  o.data = "synthetic:1200";
  o.epochs = 20;
  o.evalEvery = 10;
  o.targetAccuracy = 0.9;  // the synthetic classes are easy to tell apart
  TrainResult r = Trainer(o).run();
  ASSERT_TRUE(r.secondsToTarget.has_value());
  EXPECT_GE(r.testAccuracy, 0.9);
  EXPECT_LT(r.steps, 20 * 1200 / 16);
}

// The message of the InvalidArgument that Trainer(o) throws; empty when it throws none.
std::string refusalOf(const TrainOptions& o) {
  try {
    Trainer t(o);
  } catch (const InvalidArgument& e) {
    return e.what();
  }
  return "";
}

TEST(Trainer, RefusesStepsBeyondTheLimit) {
  TrainOptions o = smallRun();
  o.steps = std::numeric_limits<int64_t>::max();  // what CLI11 makes of --steps 100000000000000000000000
  EXPECT_NE(refusalOf(o).find("--steps must be in 0..1000000000000, got 9223372036854775807"), std::string::npos)
      << refusalOf(o);
}

TEST(Trainer, RefusesAnOuterLearningRateThatIsNotFinite) {
  TrainOptions o = smallRun();
  o.strategy.average.outerLr = std::numeric_limits<double>::infinity();
  EXPECT_NE(refusalOf(o).find("--outer-lr must be a positive number, got inf"), std::string::npos) << refusalOf(o);
}

TEST(Trainer, RefusesABatchLargerThanTheTrainingSet) {
  TrainOptions o = smallRun();
  o.data = "synthetic:60";
  o.batch = 100;
  EXPECT_NE(refusalOf(o).find("--batch 100 is larger than the 60 training examples of --data synthetic:60: use "
                              "--batch of at most 60"),
            std::string::npos)
      << refusalOf(o);
}

// Options that would silently do nothing.
TEST(Trainer, RefusesOptionsThatCannotAct) {
  TrainOptions o = smallRun();
  o.checkpointEvery = 10;
  EXPECT_NE(refusalOf(o).find("--checkpoint-every 10 without --checkpoint-dir writes no checkpoint"), std::string::npos)
      << refusalOf(o);
  o = smallRun();
  o.maxSeconds = 5;
  EXPECT_NE(refusalOf(o).find("--max-seconds stops the run at an evaluation, and with --eval-every 0"),
            std::string::npos)
      << refusalOf(o);
  o = smallRun();
  o.targetAccuracy = 0.5;
  EXPECT_NE(refusalOf(o).find("--target-accuracy stops the run at an evaluation"), std::string::npos) << refusalOf(o);
  // The chief's model under pipeline and tensor is a part: its file named the whole model and
  // could not be loaded.
  for (Scheme scheme : {Scheme::kPipeline, Scheme::kTensor}) {
    o = smallRun();
    o.strategy.scheme = scheme;
    o.saveModelPath = "/tmp/never-written.pt";
    EXPECT_NE(refusalOf(o).find("--save-model writes the whole model, and --strategy " +
                                std::string(schemeName(scheme)) + " keeps a part of it on each process"),
              std::string::npos)
        << refusalOf(o);
    o.saveModelPath = "/tmp/never-written-{rank}.pt";  // each process writes its own part
    EXPECT_EQ(refusalOf(o).find("--save-model"), std::string::npos) << refusalOf(o);
  }
}

// A TorchScript model of 5 outputs on 10 classes failed at its first step with torch's "Target 5
// is out of bounds"; it is refused before training, naming both.
TEST(Trainer, RefusesAScriptedModelOfOtherOutputsThanClasses) {
  test::TempDir dir;
  const std::string model = dir.file("five.pt");
  auto script =
      test::runCommand(test::python() +
                       " -c 'import sys, torch; from torch import nn; "
                       "torch.jit.script(nn.Sequential(nn.Flatten(), nn.Linear(784, 5))).save(sys.argv[1])' " +
                       model);
  ASSERT_EQ(script.exitCode, 0) << script.output;
  TrainOptions o = smallRun();
  o.model = model;
  o.steps = 1;
  EXPECT_NE(refusalOf(o).find("--model " + model +
                              " gives outputs of shape [2, 5] for 2 examples, and --data "
                              "synthetic:640 has 10 classes"),
            std::string::npos)
      << refusalOf(o);
}

// Options the model cannot train under, refused before the first step: --average-optimizer-state
// over sparse tables failed as "this optimizer's state would not be averaged" whatever --optimizer
// said; --autocast fp16 with an LSTM on the CPU failed in oneDNN.
TEST(Trainer, RefusesWhatTheModelCannotTrainUnder) {
  const auto refusal = [](const TrainOptions& o, torch::nn::Module& model) {
    try {
      checkModelForRun(o, model, c10::Device(c10::kCPU));
    } catch (const InvalidArgument& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  TrainOptions o = smallRun();
  o.strategy.scheme = Scheme::kAverage;
  o.strategy.average.averageOptimizerState = true;
  o.model = "embed:rows=100";
  auto bags = makeModel(o.model, {.featureRows = 100});
  EXPECT_NE(refusal(o, *bags).find("--average-optimizer-state: --model embed:rows=100 has sparse embedding tables"),
            std::string::npos)
      << refusal(o, *bags);
  auto dense = makeModel("embed:rows=100,sparse=0", {.featureRows = 100});
  EXPECT_EQ(refusal(o, *dense), "");
  o = smallRun();
  o.model = "lstm";
  o.strategy.autocast = c10::kHalf;
  auto lstm = makeModel("lstm", {});
  EXPECT_NE(refusal(o, *lstm).find("--autocast fp16 on the CPU: --model lstm has a recurrent layer"), std::string::npos)
      << refusal(o, *lstm);
  o.strategy.autocast = c10::kBFloat16;
  EXPECT_EQ(refusal(o, *lstm), "");
}

TEST(Trainer, RejectsBadOptions) {
  TrainOptions o = smallRun();
  o.batch = -1;
  EXPECT_THROW(validate(o), InvalidArgument);
  o = smallRun();
  o.resume = true;
  EXPECT_THROW(validate(o), InvalidArgument);
}

// An optimizer's name is parsed once, at the edge (the command line refuses any other:
// Cli.UnknownOptimizerNamesTheChoices); every name round-trips and no other text parses.
TEST(Optimizer, EveryNameParsesBackToItsKindAndNothingElseParses) {
  for (OptimizerKind k : allOptimizers()) EXPECT_EQ(parseOptimizer(optimizerName(k)), k) << optimizerName(k);
  EXPECT_EQ(allOptimizers().size(), 4u);
  EXPECT_EQ(parseOptimizer("rmsprop"), std::nullopt);
  EXPECT_EQ(parseOptimizer("Adam"), std::nullopt);
  EXPECT_EQ(parseOptimizer(""), std::nullopt);
  EXPECT_STREQ(optimizerName(OptimizerKind::kMomentum), "momentum");  // TrainOptions' default, as --help shows it
}

// A scheme's name is parsed once, at the edge; every name round-trips and no other text parses.
TEST(Scheme, EveryNameParsesBackToItsSchemeAndNothingElseParses) {
  for (Scheme s : allSchemes()) EXPECT_EQ(parseScheme(schemeName(s)), s) << schemeName(s);
  EXPECT_EQ(allSchemes().size(), 10u);
  EXPECT_EQ(parseScheme("telepathy"), std::nullopt);
  EXPECT_EQ(parseScheme("Allreduce"), std::nullopt);
  EXPECT_EQ(parseScheme(""), std::nullopt);
  EXPECT_EQ(schemeNames(), "local, allreduce, average, ps, gossip, pipeline, tensor, mirrored, central, hogwild");
}

}  // namespace
}  // namespace cohort::trainer_test
