// Model parallelism with real processes on 127.0.0.1: a pipelined step equals one step on the
// whole batch (every schedule, stages and micro-batch counts), stages x replicas equals the
// doubled batch, activation memory under each schedule, bad input, a killed stage, and resume.
#include <cohort/checkpoint.h>
#include <cohort/models.h>

#include <nlohmann/json.hpp>

#include <filesystem>
#include <functional>
#include <map>

#include <torch/torch.h>

#include "model_util.h"
#include "schemes/pipeline_plan.h"
#include "schemes/pipeline_split.h"
#include "test_util.h"

#include <csignal>

namespace cohort::pipeline_test {
namespace {

using test::maxDifference;

std::string launch(int n) { return test::launchPrefix(n); }

// Plain SGD, a few steps, one thread per process: the equivalence runs.
const std::string kCommon =
    " train --model mlp --data synthetic:1200 --optimizer sgd --lr 0.1 --steps 4 --threads 1 --progress off";

std::vector<torch::Tensor> parametersOf(torch::nn::Module& m) {
  std::vector<torch::Tensor> out;
  for (auto& p : m.parameters()) out.push_back(p.detach().clone());
  return out;
}

// The whole model's parameters, from the files each stage saved (stage s in files[s]), cut as
// `cut` says (layers per stage).
std::vector<torch::Tensor> loadStages(const std::vector<std::string>& files, const std::vector<int>& cut,
                                      const std::string& model = "mlp") {
  auto whole = makeModel(model, {});
  std::vector<torch::Tensor> out;
  int first = 0;
  for (size_t s = 0; s < files.size(); ++s) {
    auto stage = sliceModel(whole, first, cut[s]);
    torch::load(stage, files[s]);
    for (auto& p : parametersOf(*stage)) out.push_back(p);
    first += cut[s];
  }
  return out;
}

// The whole model's parameters from the stages' files, by name: a layer split between two stages
// (--partition L+C) is its parts' rows concatenated in stage order.
std::vector<torch::Tensor> loadSplitStages(const std::vector<std::string>& files, const std::string& model) {
  auto whole = makeModel(model, {});
  std::vector<torch::serialize::InputArchive> archives(files.size());
  for (size_t s = 0; s < files.size(); ++s) archives[s].load_from(files[s]);
  std::vector<torch::Tensor> out;
  for (const auto& layer : whole->named_children()) {
    for (const auto& p : layer.value()->named_parameters(/*recurse=*/false)) {
      std::vector<torch::Tensor> parts;
      for (auto& archive : archives) {
        torch::serialize::InputArchive sub;
        torch::Tensor t;
        if (archive.try_read(layer.key(), sub) && sub.try_read(p.key(), t)) parts.push_back(t);
      }
      EXPECT_FALSE(parts.empty()) << "no stage holds " << layer.key() << "." << p.key();
      if (!parts.empty()) out.push_back(torch::cat(parts, 0));
    }
  }
  return out;
}

std::vector<int> cutOf(const nlohmann::json& done) {
  std::vector<int> cut;
  for (const auto& c : done["cut"]) cut.push_back(c.get<int>());
  return cut;
}

std::vector<torch::Tensor> trainSingle(const test::TempDir& dir, int batch) {
  auto r = test::runCommand(test::cohortBinary() + kCommon + " --batch " + std::to_string(batch) + " --save-model " +
                                dir.file("single.pt"), 120);
  EXPECT_EQ(r.exitCode, 0) << r.output;
  return test::loadParameters(dir.file("single.pt"));
}

std::vector<torch::Tensor> initialMlp() {
  torch::manual_seed(1);
  auto init = makeModel("mlp", {});
  return parametersOf(*init);
}

// S stages, every micro-batch count and both schedules, against one process on the same batches.
void expectPipelinesEqualOneProcess(int stages, const std::string& partition) {
  test::TempDir dir;
  const auto single = trainSingle(dir, 8);
  ASSERT_GT(maxDifference(initialMlp(), single), 1e-3);  // training moved the parameters
  for (const std::string schedule : {"gpipe", "1f1b"}) {
    for (int micro : {1, 2, 4}) {
      SCOPED_TRACE(schedule + " with " + std::to_string(micro) + " micro-batches");
      const std::string metrics = dir.file(schedule + std::to_string(micro) + ".jsonl");
      auto r = test::runCommand(launch(stages) + test::cohortBinary() + kCommon +
                                    " --batch 8 --strategy pipeline --stages " + std::to_string(stages) +
                                    " --micro-batches " + std::to_string(micro) + " --schedule " + schedule +
                                    " --partition " + partition + " --metrics " + metrics + " --save-model " +
                                    dir.file("stage{rank}.pt"),
                                120);
      ASSERT_EQ(r.exitCode, 0) << r.output;
      const auto done = test::lastEvent(metrics, "done");
      std::vector<std::string> files;
      for (int s = 0; s < stages; ++s) files.push_back(dir.file("stage" + std::to_string(s) + ".pt"));
      EXPECT_LT(maxDifference(single, loadStages(files, cutOf(done))), 1e-5);
      EXPECT_EQ(done["steps"], 4);
      EXPECT_EQ(done["micro_batches"], micro);
      // The chief's loss is the last stage's, sent back: a real number, not a placeholder.
      EXPECT_GT(test::lastEvent(metrics, "step")["loss"].get<double>(), 0.1);
    }
  }
}

TEST(Pipeline, TwoStagesEqualOneProcessForEveryScheduleAndMicroBatchCount) {
  expectPipelinesEqualOneProcess(2, "auto");
}

// The first stage is the Flatten alone: a stage with no parameters and nothing to differentiate.
TEST(Pipeline, ThreeStagesEqualOneProcessForEveryScheduleAndMicroBatchCount) {
  expectPipelinesEqualOneProcess(3, "1,3,2");
}

TEST(Pipeline, TwoStagesTimesTwoReplicasEqualOneProcessWithTheDoubledBatch) {
  test::TempDir dir;
  const auto single = trainSingle(dir, 16);
  auto r = test::runCommand(launch(4) + test::cohortBinary() + kCommon +
                                " --batch 8 --strategy pipeline --stages 2 --replicas 2 --micro-batches 2"
                                " --partition 3,3 --metrics " + dir.file("m.jsonl") + " --save-model " +
                                dir.file("rank{rank}.pt"),
                            120);
  ASSERT_EQ(r.exitCode, 0) << r.output;
  const std::vector<int> cut{3, 3};
  const auto replica0 = loadStages({dir.file("rank0.pt"), dir.file("rank1.pt")}, cut);
  const auto replica1 = loadStages({dir.file("rank2.pt"), dir.file("rank3.pt")}, cut);
  EXPECT_LT(maxDifference(single, replica0), 1e-5);
  EXPECT_EQ(maxDifference(replica0, replica1), 0.0);
  const auto done = test::lastEvent(dir.file("m.jsonl"), "done");
  EXPECT_EQ(done["replicas"], 2);
  EXPECT_EQ(test::lastEvent(dir.file("m.jsonl"), "step")["samples"], 16);  // each sample once
}

// With micro-batches of 4 examples, GPipe holds all M of them at stage 0's peak, 1F1B at most S.
TEST(Pipeline, OneFOneBBoundsActivationMemoryWhileGpipeGrowsWithMicroBatches) {
  test::TempDir dir;
  std::map<std::string, int64_t> peak;
  for (const std::string schedule : {"gpipe", "1f1b"}) {
    for (int micro : {2, 8}) {
      const std::string key = schedule + std::to_string(micro);
      auto r = test::runCommand(launch(2) + test::cohortBinary() +
                                    " train --model mlp --data synthetic:1200 --steps 2 --threads 1 --progress off"
                                    " --strategy pipeline --stages 2 --partition 3,3 --schedule " + schedule +
                                    " --micro-batches " + std::to_string(micro) + " --batch " +
                                    std::to_string(4 * micro) + " --metrics " + dir.file(key + ".jsonl"),
                                120);
      ASSERT_EQ(r.exitCode, 0) << r.output;
      const auto done = test::lastEvent(dir.file(key + ".jsonl"), "done");
      ASSERT_EQ(done["stage_peak_activation_bytes"].size(), 2u) << done.dump();
      peak[key] = done["stage_peak_activation_bytes"][0].get<int64_t>();
      EXPECT_GE(done["bubble_fraction"].get<double>(), 0.0);
    }
  }
  EXPECT_GT(peak["gpipe2"], 0);
  EXPECT_GT(double(peak["gpipe8"]) / double(peak["gpipe2"]), 3.0);
  EXPECT_LT(double(peak["1f1b8"]) / double(peak["1f1b2"]), 1.5);
  EXPECT_LT(double(peak["1f1b8"]) / double(peak["gpipe8"]), 0.5);
}

void expectRefused(const std::string& command, const std::string& message) {
  test::TempDir dir;
  auto r = test::runCommand(command + " --metrics " + dir.file("m.jsonl"), 120);
  EXPECT_EQ(r.exitCode, 2) << r.output;
  EXPECT_NE(r.output.find(message), std::string::npos) << r.output;
  EXPECT_TRUE(test::lastEvent(dir.file("m.jsonl"), "step").is_null()) << "a step was trained";
}

TEST(Pipeline, BadInputIsRefusedBeforeTraining) {
  const std::string train = test::cohortBinary() + " train --data synthetic:600 --steps 2 --threads 1 --progress off"
                                                   " --strategy pipeline";
  expectRefused(train + " --stages 2", "needs 2 processes (cohort launch -n 2), but this job has 1");
  expectRefused(launch(2) + train + " --model mlp --stages 2 --partition 2,3",
                "--partition 2,3 covers 5 layers but the model has 6");
  expectRefused(launch(4) + train + " --model lstm --stages 4",
                "--stages 4 is more than the model's 3 layers (0 RowsAsSequence, 1 LastStepLstm, 2 Linear)");
  test::TempDir dir;
  auto script = test::runCommand(test::python() + " " + test::sourceDir() + "/examples/make_torchscript.py " +
                                 dir.file("custom.pt") + " --custom");
  ASSERT_EQ(script.exitCode, 0) << script.output;
  expectRefused(launch(2) + train + " --model " + dir.file("custom.pt") + " --stages 2",
                "top level is not an nn.Sequential");
}

// A layer split by output channels between two stages: a Linear of the mlp (the first, whose
// input is the data's, and a hidden one) and the cnn's second convolution; the step still equals
// one step on the whole batch, up to the order of the sums over the split layer's channels.
TEST(Pipeline, SplitLayerCutsEqualOneProcess) {
  test::TempDir dir;
  for (const std::string model : {"mlp", "cnn"}) {
    const std::string common = " train --model " + model +
                               " --data synthetic:1200 --optimizer sgd --lr 0.1 --steps 4 --threads 1 --progress off"
                               " --batch 8";
    auto r = test::runCommand(test::cohortBinary() + common + " --save-model " + dir.file(model + ".pt"), 120);
    ASSERT_EQ(r.exitCode, 0) << r.output;
    const auto single = test::loadParameters(dir.file(model + ".pt"), model);
    if (model == "mlp") ASSERT_GT(maxDifference(initialMlp(), single), 1e-3);  // training moved the parameters
    struct Case {
      std::string cut;
      std::vector<int> counts;
      int channels;
    };
    const std::vector<Case> cases = model == "mlp"
                                        ? std::vector<Case>{{"1+100,5", {1, 5}, 100}, {"3+7,3", {3, 3}, 7}}
                                        : std::vector<Case>{{"2+19,6", {2, 6}, 19}};
    for (const auto& c : cases) {
      for (const std::string schedule : {"gpipe", "1f1b"}) {
        SCOPED_TRACE(model + " cut " + c.cut + " " + schedule);
        const std::string metrics = dir.file("split.jsonl");
        std::filesystem::remove(metrics);
        r = test::runCommand(launch(2) + test::cohortBinary() + common +
                                 " --strategy pipeline --stages 2 --micro-batches 3 --schedule " + schedule +
                                 " --partition " + c.cut + " --metrics " + metrics + " --save-model " +
                                 dir.file("stage{rank}.pt"),
                             120);
        ASSERT_EQ(r.exitCode, 0) << r.output;
        EXPECT_LT(maxDifference(single, loadSplitStages({dir.file("stage0.pt"), dir.file("stage1.pt")}, model)), 1e-5);
        const auto done = test::lastEvent(metrics, "done");
        EXPECT_EQ(cutOf(done), c.counts);
        EXPECT_EQ(done["cut_split_channels"], nlohmann::json::array({c.channels, 0}));
      }
    }
  }
}

// --partition split picks a valid cut (whole layers or one split), prints it, and trains exactly
// as that cut given explicitly.
TEST(Pipeline, SplitPartitionPicksAValidCutAndTrainsAsThatCutGiven) {
  test::TempDir dir;
  const std::string common = launch(2) + test::cohortBinary() +
                             " train --model cnn --data synthetic:1200 --optimizer sgd --lr 0.1 --steps 4 --threads 1"
                             " --progress off --batch 16 --strategy pipeline --stages 2 --micro-batches 2"
                             " --save-model " + dir.file("{rank}");
  auto r = test::runCommand(common + " --partition split --metrics " + dir.file("auto.jsonl"), 120);
  ASSERT_EQ(r.exitCode, 0) << r.output;
  EXPECT_NE(r.output.find("--partition split measured forward+backward per layer"), std::string::npos) << r.output;
  const auto done = test::lastEvent(dir.file("auto.jsonl"), "done");
  const std::vector<int> counts = cutOf(done);
  std::vector<int> splits;
  for (const auto& c : done["cut_split_channels"]) splits.push_back(c.get<int>());
  ASSERT_EQ(counts.size(), 2u);
  ASSERT_EQ(splits.size(), 2u);
  EXPECT_EQ(counts[0] + counts[1], 8);
  EXPECT_GE(counts[0], 1);
  EXPECT_GE(counts[1], 1);
  EXPECT_EQ(splits[1], 0);
  if (splits[0] > 0) {  // only the convolutions (32, 64 channels) and the Linears (1024, 10) split
    const std::map<int, int> channels{{0, 32}, {2, 64}, {5, 1024}, {7, 10}};
    ASSERT_EQ(channels.count(counts[0]), 1u) << joinCut(counts, splits);
    EXPECT_LT(splits[0], channels.at(counts[0]));
  }
  const std::string cut = joinCut(counts, splits);
  EXPECT_NE(r.output.find("cut " + cut + " ("), std::string::npos) << r.output;
  for (int s = 0; s < 2; ++s) std::filesystem::rename(dir.file(std::to_string(s)), dir.file("auto" + std::to_string(s)));
  const auto automatic = loadSplitStages({dir.file("auto0"), dir.file("auto1")}, "cnn");

  r = test::runCommand(common + " --partition " + cut + " --metrics " + dir.file("explicit.jsonl"), 120);
  ASSERT_EQ(r.exitCode, 0) << r.output;
  const auto given = loadSplitStages({dir.file("0"), dir.file("1")}, "cnn");
  EXPECT_EQ(maxDifference(automatic, given), 0.0);
}

TEST(Pipeline, BadSplitCutsAreRefusedInOneLine) {
  const std::string train = launch(2) + test::cohortBinary() +
                            " train --model mlp --data synthetic:600 --steps 2 --threads 1 --progress off"
                            " --strategy pipeline --stages 2 --batch 8";
  expectRefused(train + " --partition 2+3,4",
                "--partition 2+3,4 splits layer 2 (ReLU), but only a Conv2d or a Linear on [batch, features] can be "
                "split by output channels");
  expectRefused(train + " --partition 1+512,5",
                "--partition 1+512,5 gives stage 0 512 output channels of layer 1 (Linear), which has 512: give 1 to "
                "511");
  expectRefused(train + " --partition 1,5+2", "the last stage has no next layer to split");
  expectRefused(train + " --partition split --micro-batches auto",
                "--partition split splits a layer, which --micro-batches auto does not model");
}

// Micro-batches of unequal sizes (8 = 3 + 3 + 2) share the kept receive buffers, each sized for
// the largest: still one step on the whole batch.
TEST(Pipeline, UnequalMicroBatchesEqualOneProcess) {
  test::TempDir dir;
  const auto single = trainSingle(dir, 8);
  for (const std::string schedule : {"gpipe", "1f1b"}) {
    SCOPED_TRACE(schedule);
    auto r = test::runCommand(launch(2) + test::cohortBinary() + kCommon +
                                  " --batch 8 --strategy pipeline --stages 2 --micro-batches 3 --partition 3,3"
                                  " --schedule " + schedule + " --save-model " + dir.file("stage{rank}.pt"),
                              120);
    ASSERT_EQ(r.exitCode, 0) << r.output;
    EXPECT_LT(maxDifference(single, loadStages({dir.file("stage0.pt"), dir.file("stage1.pt")}, {3, 3})), 1e-5);
  }
}

TEST(Pipeline, BadMicroBatchCountsAreRefusedInOneLine) {
  const std::string train = test::cohortBinary() + " train --data synthetic:600 --steps 2 --threads 1 --progress off"
                                                   " --strategy pipeline --batch 8";
  expectRefused(train + " --micro-batches 0", "--micro-batches 0: a batch needs at least 1 micro-batch");
  expectRefused(train + " --micro-batches many", "--micro-batches 'many' is not a number");
  expectRefused(train + " --micro-batches 9", "--micro-batches 9 is more than --batch 8");
}

// auto measures and picks M in [1, batch], reports it, and trains exactly as that M given
// explicitly (a fixed cut, so that only M is chosen).
TEST(Pipeline, AutoMicroBatchesPicksAValidCountAndTrainsAsThatCount) {
  test::TempDir dir;
  const std::string common = launch(2) + test::cohortBinary() + kCommon +
                             " --batch 8 --strategy pipeline --stages 2 --partition 3,3 --save-model " +
                             dir.file("{rank}");
  auto r = test::runCommand(common + " --micro-batches auto --metrics " + dir.file("auto.jsonl"), 120);
  ASSERT_EQ(r.exitCode, 0) << r.output;
  EXPECT_NE(r.output.find("--micro-batches auto chose M = "), std::string::npos) << r.output;
  const auto done = test::lastEvent(dir.file("auto.jsonl"), "done");
  ASSERT_TRUE(done["micro_batches_auto"].get<bool>());
  const int chosen = done["micro_batches"].get<int>();
  ASSERT_GE(chosen, 1);
  ASSERT_LE(chosen, 8);
  EXPECT_GT(done["micro_batch_fixed_cost_s"].get<double>(), 0.0);
  EXPECT_EQ(test::lastEvent(dir.file("auto.jsonl"), "step")["micro_batches"], chosen);
  for (int s = 0; s < 2; ++s) std::filesystem::rename(dir.file(std::to_string(s)), dir.file("auto" + std::to_string(s)));
  const auto automatic = loadStages({dir.file("auto0"), dir.file("auto1")}, {3, 3});
  ASSERT_GT(maxDifference(initialMlp(), automatic), 1e-3);  // training moved the parameters

  r = test::runCommand(common + " --micro-batches " + std::to_string(chosen) + " --metrics " +
                           dir.file("explicit.jsonl"),
                       120);
  ASSERT_EQ(r.exitCode, 0) << r.output;
  EXPECT_FALSE(test::lastEvent(dir.file("explicit.jsonl"), "done")["micro_batches_auto"].get<bool>());
  const auto given = loadStages({dir.file("0"), dir.file("1")}, {3, 3});
  EXPECT_EQ(maxDifference(automatic, given), 0.0);
}

// No launcher: stage 1 of 3 is SIGKILLed once training runs (after its 5th step); stages 0 and 2
// must each stop within the timeout, naming it.
TEST(Pipeline, KilledStageStopsTheOthersNamingIt) {
  const std::string train = test::cohortBinary() +
                            " train --model mlp --data synthetic:6000 --batch 8 --threads 1 --progress off"
                            " --steps 1000000 --timeout 20 --strategy pipeline --stages 3 --micro-batches 2";
  test::Process stage0("MASTER_ADDR=127.0.0.1 MASTER_PORT=0 WORLD_SIZE=3 RANK=0 " + train);
  const int port = stage0.port();
  ASSERT_GT(port, 0) << stage0.output();
  const std::string env = "MASTER_ADDR=127.0.0.1 MASTER_PORT=" + std::to_string(port) + " WORLD_SIZE=3";
  test::Process victim(env + " RANK=1 " + train + " --test-kill-at 1:5");
  test::Process stage2(env + " RANK=2 " + train);
  const test::CommandResult v = victim.wait(std::chrono::seconds(120));
  const test::CommandResult r0 = stage0.wait(std::chrono::seconds(120));
  const test::CommandResult r2 = stage2.wait(std::chrono::seconds(60));
  EXPECT_EQ(v.exitCode, 128 + SIGKILL) << v.output;
  EXPECT_EQ(r0.exitCode, 1) << r0.output;
  EXPECT_EQ(r2.exitCode, 1) << r2.output;
  EXPECT_NE(r0.output.find("lost rank 1 (stage 1)"), std::string::npos) << r0.output;
  EXPECT_NE(r2.output.find("lost rank 1 (stage 1)"), std::string::npos) << r2.output;
}

// Per-stage checkpoints: a resumed run ends where an uninterrupted one does; another cut is refused.
TEST(Pipeline, ResumeFromStageCheckpointsIsExactAndAnotherCutIsRefused) {
  test::TempDir dir;
  const std::string train = launch(2) + test::cohortBinary() +
                            " train --model mlp --data synthetic:1200 --batch 8 --threads 1 --progress off"
                            " --optimizer momentum --strategy pipeline --stages 2 --micro-batches 2";
  auto whole = test::runCommand(train + " --partition 3,3 --steps 8 --save-model " + dir.file("whole{rank}.pt"), 120);
  ASSERT_EQ(whole.exitCode, 0) << whole.output;
  const std::string ckpt = " --checkpoint-dir " + dir.file("ckpt");
  auto first = test::runCommand(train + " --partition 3,3 --steps 5" + ckpt, 120);
  ASSERT_EQ(first.exitCode, 0) << first.output;
  EXPECT_TRUE(std::filesystem::exists(dir.file("ckpt/pipeline.manifest")));
  const auto saved = CheckpointStore(dir.file("ckpt/stage-1")).list();
  ASSERT_FALSE(saved.empty());
  EXPECT_EQ(saved.front().step, 5);
  EXPECT_FALSE(CheckpointStore(dir.file("ckpt/stage-0")).list().empty());
  // auto takes the checkpoints' cut.
  auto resumed = test::runCommand(train + " --partition auto --steps 8 --resume" + ckpt + " --save-model " +
                                      dir.file("resumed{rank}.pt"), 120);
  ASSERT_EQ(resumed.exitCode, 0) << resumed.output;
  EXPECT_NE(resumed.output.find("resumed from " + saved.front().path), std::string::npos)
      << resumed.output;
  const std::vector<int> cut{3, 3};
  EXPECT_LT(maxDifference(loadStages({dir.file("whole0.pt"), dir.file("whole1.pt")}, cut),
                          loadStages({dir.file("resumed0.pt"), dir.file("resumed1.pt")}, cut)),
            1e-6);
  auto refused = test::runCommand(train + " --partition 2,4 --steps 10 --resume" + ckpt, 120);
  EXPECT_EQ(refused.exitCode, 2) << refused.output;
  EXPECT_NE(refused.output.find("the checkpoints cut the model as 3,3"), std::string::npos) << refused.output;
  // Another model: its layers are not the manifest's (an auto cut indexed past them: undefined
  // behaviour, std::bad_array_new_length).
  auto another = test::runCommand(launch(2) + test::cohortBinary() +
                                      " train --model cnn --data synthetic:1200 --batch 8 --threads 1 --progress off"
                                      " --strategy pipeline --stages 2 --steps 10 --resume" +
                                      ckpt,
                                  120);
  EXPECT_EQ(another.exitCode, 2) << another.output;
  EXPECT_NE(another.output.find("the checkpoints are of a model of 6 layers (cut 3,3), and this run's model has 8"),
            std::string::npos)
      << another.output;
}

// Two parts of one model, each writing its own checkpoints under `subdir`-0/ and -1/ (pipeline
// stages, tensor ways), part 0 killed inside its step-6 write (its step-6 file removed while part
// 1's is there): the resumed run takes the newest step both parts have, 4. Runs an uninterrupted
// 8 steps (`outputs` given "whole"), the 6 steps with checkpoints, and the resumed 8 (`outputs`
// given "resumed"); the caller compares the two runs' ends.
void expectPartsResumeFromTheNewestCommonStep(const test::TempDir& dir, const std::string& train,
                                              const std::string& subdir,
                                              const std::function<std::string(const std::string&)>& outputs) {
  auto whole = test::runCommand(train + " --steps 8" + outputs("whole"), 120);
  ASSERT_EQ(whole.exitCode, 0) << whole.output;
  const std::string ckpt = " --checkpoint-dir " + dir.file("ckpt") + " --checkpoint-every 2";
  auto first = test::runCommand(train + " --steps 6" + ckpt, 120);
  ASSERT_EQ(first.exitCode, 0) << first.output;
  auto part0 = CheckpointStore(dir.file("ckpt/" + subdir + "-0")).list();
  ASSERT_GE(part0.size(), 2u);
  ASSERT_EQ(part0[0].step, 6);
  ASSERT_EQ(part0[1].step, 4);
  ASSERT_EQ(CheckpointStore(dir.file("ckpt/" + subdir + "-1")).list().front().step, 6);
  std::filesystem::remove(part0[0].path);
  auto resumed = test::runCommand(train + " --steps 8 --resume" + ckpt + outputs("resumed"), 120);
  ASSERT_EQ(resumed.exitCode, 0) << resumed.output;
  EXPECT_NE(resumed.output.find("resuming every part from step 4"), std::string::npos) << resumed.output;
  EXPECT_NE(resumed.output.find("resumed from " + dir.file("ckpt/" + subdir + "-1") + "/ckpt-0000000004.ckpt (step 4"),
            std::string::npos)
      << resumed.output;
}

// Pipeline stages: the resumed run's stages end where an uninterrupted run's do.
TEST(Pipeline, StagesWhoseNewestCheckpointsDifferResumeFromTheNewestCommonStep) {
  test::TempDir dir;
  const std::string train = launch(2) + test::cohortBinary() +
                            " train --model mlp --data synthetic:1200 --batch 8 --threads 1 --progress off"
                            " --optimizer momentum --strategy pipeline --stages 2 --micro-batches 2 --partition 3,3";
  expectPartsResumeFromTheNewestCommonStep(dir, train, "stage", [&](const std::string& run) {
    return " --save-model " + dir.file(run + "{rank}.pt");
  });
  if (HasFatalFailure()) return;
  const std::vector<int> cut{3, 3};
  EXPECT_LT(maxDifference(loadStages({dir.file("whole0.pt"), dir.file("whole1.pt")}, cut),
                          loadStages({dir.file("resumed0.pt"), dir.file("resumed1.pt")}, cut)),
            1e-6);
}

// Tensor ways (the fault table's tensor ckpt row): the resumed run ends with the uninterrupted
// run's test loss (the chief's, computed over both halves of every split layer).
TEST(Pipeline, TensorWaysWhoseNewestCheckpointsDifferResumeFromTheNewestCommonStep) {
  test::TempDir dir;
  const std::string train = launch(2) + test::cohortBinary() +
                            " train --model mlp --data synthetic:1200 --batch 8 --threads 1 --progress off"
                            " --optimizer momentum --strategy tensor --ways 2";
  expectPartsResumeFromTheNewestCommonStep(dir, train, "way", [&](const std::string& run) {
    return " --metrics " + dir.file(run + ".jsonl");
  });
  if (HasFatalFailure()) return;
  const auto whole = test::lastEvent(dir.file("whole.jsonl"), "done");
  const auto resumed = test::lastEvent(dir.file("resumed.jsonl"), "done");
  EXPECT_EQ(resumed.value("steps", 0), 8);
  EXPECT_NEAR(resumed.value("test_loss", -1.0), whole.value("test_loss", 1.0), 1e-6);
}

// A cut that splits a layer by output channels checkpoints and resumes like a whole-layer cut:
// the resumed run ends where an uninterrupted one does, `split` takes the checkpoints' cut
// instead of timing a new one, and another split of the same layer is refused.
TEST(Pipeline, ResumeFromSplitCutCheckpointsIsExactAndAnotherSplitIsRefused) {
  test::TempDir dir;
  const std::string train = launch(2) + test::cohortBinary() +
                            " train --model mlp --data synthetic:1200 --batch 8 --threads 1 --progress off"
                            " --optimizer momentum --strategy pipeline --stages 2 --micro-batches 2";
  auto whole = test::runCommand(train + " --partition 1+100,5 --steps 8 --save-model " + dir.file("whole{rank}.pt"),
                                120);
  ASSERT_EQ(whole.exitCode, 0) << whole.output;
  const std::string ckpt = " --checkpoint-dir " + dir.file("ckpt");
  auto first = test::runCommand(train + " --partition 1+100,5 --steps 5" + ckpt, 120);
  ASSERT_EQ(first.exitCode, 0) << first.output;
  const auto saved = CheckpointStore(dir.file("ckpt/stage-0")).list();
  ASSERT_FALSE(saved.empty());
  EXPECT_EQ(saved.front().step, 5);
  auto resumed = test::runCommand(train + " --partition split --steps 8 --resume" + ckpt + " --save-model " +
                                      dir.file("resumed{rank}.pt"),
                                  120);
  ASSERT_EQ(resumed.exitCode, 0) << resumed.output;
  EXPECT_NE(resumed.output.find("resuming with the checkpoints' cut 1+100,5"), std::string::npos) << resumed.output;
  EXPECT_EQ(resumed.output.find("measured forward+backward per layer"), std::string::npos) << resumed.output;
  const auto expected = loadSplitStages({dir.file("whole0.pt"), dir.file("whole1.pt")}, "mlp");
  const auto got = loadSplitStages({dir.file("resumed0.pt"), dir.file("resumed1.pt")}, "mlp");
  ASSERT_EQ(expected.size(), got.size());
  EXPECT_LT(maxDifference(expected, got), 1e-6);
  auto refused = test::runCommand(train + " --partition 1+50,5 --steps 10 --resume" + ckpt, 120);
  EXPECT_EQ(refused.exitCode, 2) << refused.output;
  EXPECT_NE(refused.output.find("the checkpoints cut the model as 1+100,5"), std::string::npos) << refused.output;
}

// A run refused for an earlier run's checkpoints leaves that run's manifest as it was (rank 0
// wrote its own cut over it while building the model, before the refusal), so the earlier run
// still resumes with its cut.
TEST(Pipeline, ARefusedNewRunLeavesTheEarlierRunsManifest) {
  test::TempDir dir;
  const std::string train = launch(2) + test::cohortBinary() +
                            " train --model mlp --data synthetic:1200 --batch 8 --threads 1 --progress off"
                            " --strategy pipeline --stages 2 --micro-batches 2 --checkpoint-dir " +
                            dir.file("ckpt");
  auto first = test::runCommand(train + " --partition 3,3 --steps 2", 120);
  ASSERT_EQ(first.exitCode, 0) << first.output;
  const std::string manifest = test::readFile(dir.file("ckpt/pipeline.manifest"));
  ASSERT_NE(manifest.find("cut 3,3"), std::string::npos) << manifest;
  auto refused = test::runCommand(train + " --partition 2,4 --steps 4", 120);
  EXPECT_EQ(refused.exitCode, 2) << refused.output;
  EXPECT_NE(refused.output.find("holds checkpoints of an earlier run"), std::string::npos) << refused.output;
  EXPECT_EQ(test::readFile(dir.file("ckpt/pipeline.manifest")), manifest);
  auto resumed = test::runCommand(train + " --partition auto --steps 3 --resume", 120);
  EXPECT_EQ(resumed.exitCode, 0) << resumed.output;
  EXPECT_NE(resumed.output.find("resuming with the checkpoints' cut 3,3"), std::string::npos) << resumed.output;
}

// A TorchScript stage whose first layer is an in-place ReLU: the interpreter rethrows autograd's
// refusal (an in-place operation on the received activation, a leaf) as std::runtime_error, not
// c10::Error, which the stage's step and the partition's timing did not catch.
TEST(Pipeline, AScriptedStageStartingWithAnInPlaceLayerTrains) {
  test::TempDir dir;
  const std::string model = dir.file("inplace.pt");
  auto script = test::runCommand(test::python() +
                                 " -c 'import sys, torch; from torch import nn; torch.manual_seed(0); "
                                 "torch.jit.script(nn.Sequential(nn.Flatten(), nn.Linear(784, 16), "
                                 "nn.ReLU(inplace=True), nn.Linear(16, 10))).save(sys.argv[1])' " +
                                 model);
  ASSERT_EQ(script.exitCode, 0) << script.output;
  for (const std::string partition : {"2,2", "auto"}) {
    SCOPED_TRACE(partition);
    auto r = test::runCommand(launch(2) + test::cohortBinary() + " train --model " + model +
                                  " --data synthetic:600 --batch 8 --steps 3 --threads 1 --progress off"
                                  " --strategy pipeline --stages 2 --micro-batches 2 --partition " +
                                  partition,
                              120);
    EXPECT_EQ(r.exitCode, 0) << r.output;
  }
}

// The stages' replicas average dense gradients: a sparse embedding table's (its touched rows) is
// refused at construction, naming the table, instead of failing inside the first step.
TEST(Pipeline, ReplicasOfASparseTableAreRefused) {
  expectRefused(launch(4) + test::cohortBinary() +
                    " train --model embed:rows=2000 --data synthetic-bags:2000,2000 --steps 2 --threads 1"
                    " --progress off --strategy pipeline --stages 2 --replicas 2",
                "is an embedding table with sparse gradients");
}

// --strategy tensor on a TorchScript model: its layers cannot be split, so every way trained the
// whole model, silently.
TEST(Pipeline, TensorWaysOverAScriptedModelAreRefused) {
  test::TempDir dir;
  auto script = test::runCommand(test::python() + " " + test::sourceDir() + "/examples/make_torchscript.py " +
                                 dir.file("seq.pt"));
  ASSERT_EQ(script.exitCode, 0) << script.output;
  expectRefused(launch(2) + test::cohortBinary() + " train --model " + dir.file("seq.pt") +
                    " --data synthetic:600 --steps 2 --threads 1 --progress off --strategy tensor --ways 2",
                "no layer of the model can be split");
}

// One process: the message names that (it said "needs 1 processes ..., but this job has 1").
TEST(Pipeline, OneProcessIsRefusedNamingWhy) {
  const std::string train =
      test::cohortBinary() + " train --model mlp --data synthetic:600 --steps 2 --threads 1 --progress off";
  expectRefused(train + " --strategy pipeline --stages 1", "is one process");
  expectRefused(train + " --strategy tensor --ways 1", "is one process");
}

}  // namespace
}  // namespace cohort::pipeline_test
