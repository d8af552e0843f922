// The pipeline's schedules and cuts, without processes.
#include <cohort/error.h>

#include <gtest/gtest.h>

#include "schemes/pipeline_plan.h"

namespace cohort::pipeline_plan_test {
namespace {

// Runs every stage's op list as far as the dependencies allow (forward of i after the forward of
// i on the stage before; backward of i after the backward of i on the stage after) and says
// whether all finished: a schedule that deadlocks, or runs an op twice, fails.
bool runsToTheEnd(PipeSchedule schedule, int stages, int micro) {
  std::vector<std::vector<PipeOp>> ops;
  for (int s = 0; s < stages; ++s) ops.push_back(makeSchedule(schedule, stages, s, micro));
  std::vector<size_t> next(size_t(stages), 0);
  std::vector<std::vector<int>> forwardDone(size_t(stages), std::vector<int>(size_t(micro), 0));
  std::vector<std::vector<int>> backwardDone = forwardDone;
  for (bool progress = true; progress;) {
    progress = false;
    for (int s = 0; s < stages; ++s) {
      if (next[size_t(s)] == ops[size_t(s)].size()) continue;
      const PipeOp op = ops[size_t(s)][next[size_t(s)]];
      const size_t i = size_t(op.micro);
      const bool ready = op.forward ? (s == 0 || forwardDone[size_t(s) - 1][i])
                                    : (forwardDone[size_t(s)][i] && (s == stages - 1 || backwardDone[size_t(s) + 1][i]));
      if (!ready) continue;
      auto& done = op.forward ? forwardDone[size_t(s)][i] : backwardDone[size_t(s)][i];
      if (done++) return false;
      ++next[size_t(s)];
      progress = true;
    }
  }
  for (int s = 0; s < stages; ++s) {
    if (next[size_t(s)] != ops[size_t(s)].size() || ops[size_t(s)].size() != size_t(2 * micro)) return false;
  }
  return true;
}

TEST(PipelinePlan, SchedulesRunToTheEndForEveryShape) {
  for (auto schedule : {PipeSchedule::kGpipe, PipeSchedule::kOneFOneB}) {
    for (int stages = 1; stages <= 5; ++stages) {
      for (int micro = 1; micro <= 9; ++micro) {
        EXPECT_TRUE(runsToTheEnd(schedule, stages, micro)) << int(schedule) << " S=" << stages << " M=" << micro;
      }
    }
  }
}

TEST(PipelinePlan, OneFOneBHoldsAtMostStagesMinusStageMicroBatches) {
  for (int stages = 1; stages <= 4; ++stages) {
    for (int micro = 1; micro <= 16; micro *= 2) {
      for (int s = 0; s < stages; ++s) {
        EXPECT_EQ(peakInFlight(makeSchedule(PipeSchedule::kOneFOneB, stages, s, micro)), std::min(micro, stages - s));
        EXPECT_EQ(peakInFlight(makeSchedule(PipeSchedule::kGpipe, stages, s, micro)), micro);
      }
    }
  }
}

TEST(PipelinePlan, OneFOneBAlternatesInTheSteadyState) {
  auto ops = makeSchedule(PipeSchedule::kOneFOneB, 3, 0, 5);
  std::string text;
  for (const auto& op : ops) text += (op.forward ? "F" : "B") + std::to_string(op.micro) + " ";
  EXPECT_EQ(text, "F0 F1 F2 B0 F3 B1 F4 B2 B3 B4 ");
}

TEST(PipelinePlan, BalanceMinimizesTheSlowestStage) {
  EXPECT_EQ(balanceStages({1, 1, 1, 1}, 2), (std::vector<int>{2, 2}));
  EXPECT_EQ(balanceStages({5, 1, 1, 1, 1, 1}, 2), (std::vector<int>{1, 5}));
  EXPECT_EQ(balanceStages({1, 2, 3, 4, 5, 6}, 3), (std::vector<int>{3, 2, 1}));  // 6 | 9 | 6
  EXPECT_EQ(balanceStages({3, 3, 3}, 3), (std::vector<int>{1, 1, 1}));
  // Not after layer 0: the cut moves.
  EXPECT_EQ(balanceStages({1, 1, 1, 1}, 2, {false, false, true, true}), (std::vector<int>{3, 1}));
  EXPECT_THROW(balanceStages({1, 1}, 3), InvalidArgument);
  EXPECT_THROW(balanceStages({1, 1, 1}, 2, {false, false, true}), InvalidArgument);
}

TEST(PipelinePlan, PartitionListsAreChecked) {
  EXPECT_EQ(partitionCut("2,4", 2, 6), (std::vector<int>{2, 4}));
  auto message = [](const std::string& text, int stages, int layers) {
    try {
      partitionCut(PipelinePartition(text), stages, layers);
    } catch (const InvalidArgument& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(message("2,3", 2, 6).find("covers 5 layers but the model has 6"), std::string::npos);
  EXPECT_NE(message("2,2,2", 2, 6).find("has 3 stages but --stages is 2"), std::string::npos);
  EXPECT_NE(message("3,x", 2, 6).find("'x' is not a positive number"), std::string::npos);
  EXPECT_NE(message("6,0", 2, 6).find("'0' is not a positive number"), std::string::npos);
  EXPECT_THROW(parseSchedule("zigzag"), InvalidArgument);
}

// The partition is parsed once, where the command line (or the library's options) gives it.
TEST(PipelinePlan, APartitionIsParsedOnceIntoAValue) {
  EXPECT_EQ(PipelinePartition().kind, PipelinePartition::Kind::kAuto);
  EXPECT_EQ(PipelinePartition("auto"), PipelinePartition());
  EXPECT_EQ(PipelinePartition("split").kind, PipelinePartition::Kind::kSplit);
  const PipelinePartition given("1,3+7,2");
  EXPECT_EQ(given.kind, PipelinePartition::Kind::kLayers);
  EXPECT_EQ(given.layers, (std::vector<int>{1, 3, 2}));
  EXPECT_EQ(given.channels, (std::vector<int>{0, 7, 0}));
  EXPECT_TRUE(given.splitsALayer());
  EXPECT_FALSE(PipelinePartition("3,3").splitsALayer());
  EXPECT_TRUE(PipelinePartition("split").splitsALayer());
  for (const char* text : {"auto", "split", "3,3", "1,3+7,2"}) EXPECT_EQ(PipelinePartition(text).text(), text);
  EXPECT_THROW(PipelinePartition("balanced"), InvalidArgument);
  EXPECT_THROW(PipelinePartition("3,3+1"), InvalidArgument);
  std::vector<int> splits;
  EXPECT_EQ(partitionCut(given, 3, 6, &splits), (std::vector<int>{1, 3, 2}));
  EXPECT_EQ(splits, (std::vector<int>{0, 7, 0}));
  EXPECT_THROW(partitionCut(given, 2, 6, &splits), InvalidArgument);  // 3 stages given
  // Built by hand, as the public fields allow: what the text refuses is refused here too.
  PipelinePartition byHand;
  byHand.kind = PipelinePartition::Kind::kLayers;
  byHand.layers = {3, 3};
  EXPECT_THROW(partitionCut(byHand, 2, 6, &splits), InvalidArgument) << "no channel counts";
  byHand.channels = {0, 0};
  EXPECT_EQ(partitionCut(byHand, 2, 6, &splits), (std::vector<int>{3, 3}));
  byHand.layers = {0, 6};
  EXPECT_THROW(partitionCut(byHand, 2, 6, &splits), InvalidArgument) << "an empty stage";
  byHand.layers = {3, 3};
  byHand.channels = {0, 2};
  EXPECT_THROW(partitionCut(byHand, 2, 6, &splits), InvalidArgument) << "the last stage split";
  EXPECT_THROW(partitionCut(PipelinePartition("split"), 2, 6), InvalidArgument);
  EXPECT_EQ(scheduleName(parseSchedule("gpipe")), "gpipe");
  EXPECT_EQ(scheduleName(parseSchedule("1f1b")), "1f1b");
}

TEST(PipelinePlan, SplitCutsAreParsedAndChecked) {
  std::vector<int> splits;
  EXPECT_EQ(partitionCut("2+19,6", 2, 8, &splits), (std::vector<int>{2, 6}));
  EXPECT_EQ(splits, (std::vector<int>{19, 0}));
  EXPECT_EQ(partitionCut("1,3+7,2", 3, 6, &splits), (std::vector<int>{1, 3, 2}));
  EXPECT_EQ(splits, (std::vector<int>{0, 7, 0}));
  EXPECT_EQ(joinCut({1, 3, 2}, {0, 7, 0}), "1,3+7,2");
  EXPECT_EQ(joinCut({2, 6}, {}), "2,6");
  auto message = [](const std::string& text, bool allowSplits) {
    std::vector<int> out;
    try {
      partitionCut(PipelinePartition(text), 2, 8, allowSplits ? &out : nullptr);
    } catch (const InvalidArgument& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(message("2+0,6", true).find("'2+0' is not a positive number of channels"), std::string::npos);
  EXPECT_NE(message("2+x,6", true).find("'2+x' is not a positive number of channels"), std::string::npos);
  EXPECT_NE(message("2++3,6", true).find("is not a positive number of channels"), std::string::npos);
  EXPECT_NE(message("+2,6", true).find("is not a positive number of layers"), std::string::npos);
  EXPECT_NE(message("2,6+3", true).find("the last stage has no next layer to split"), std::string::npos);
  EXPECT_NE(message("2+3,6", false).find("splits a layer, which is not allowed here"), std::string::npos);
}

TEST(PipelinePlan, SplitBalanceCutsInsideALayerOnlyWhereItPays) {
  // Layer 1 (4 channels) holds 3 of the 4: whole layers leave 1 | 3; a split gives stage 0 one
  // of its channels: 1.75 | 2.25.
  SplitCut c = balanceStagesSplit({1, 3}, 2, {}, {0, 4});
  EXPECT_EQ(c.counts, (std::vector<int>{1, 1}));
  EXPECT_EQ(c.splits, (std::vector<int>{1, 0}));
  EXPECT_DOUBLE_EQ(c.slowest, 2.25);
  // Equal layers: nothing to gain, no split.
  c = balanceStagesSplit({1, 1}, 2, {}, {4, 4});
  EXPECT_EQ(c.splits, (std::vector<int>{0, 0}));
  EXPECT_DOUBLE_EQ(c.slowest, 1.0);
  // A gain under 5% is not worth the split: 1 | 1.09 whole, 1.045 with a split.
  c = balanceStagesSplit({1, 1.09}, 2, {}, {0, 100});
  EXPECT_EQ(c.splits, (std::vector<int>{0, 0}));
  // Layer 2's input does not have the batch first (no cut after layer 1), so it is not split.
  c = balanceStagesSplit({1, 1, 4}, 2, {true, false, true}, {0, 0, 8});
  EXPECT_EQ(c.counts, (std::vector<int>{1, 2}));
  EXPECT_EQ(c.splits, (std::vector<int>{0, 0}));
  // Three stages around one large layer of 64 channels: it is split once, never into three.
  c = balanceStagesSplit({1, 6, 1}, 3, {}, {0, 64, 0});
  int split = 0;
  for (int x : c.splits) split += x > 0;
  EXPECT_EQ(split, 1);
  EXPECT_EQ(c.counts[0] + c.counts[1] + c.counts[2], 3);
  for (int n : c.counts) EXPECT_GE(n, 1);
  EXPECT_LT(c.slowest, 6.0 * 0.95);
  // More than 64 channels: split points on a grid of 64 evenly spaced counts.
  c = balanceStagesSplit({0, 1}, 2, {}, {0, 1000});
  EXPECT_EQ(c.counts, (std::vector<int>{1, 1}));
  EXPECT_NEAR(c.splits[0], 500, 1000 / 64);
  EXPECT_NEAR(c.slowest, 0.5, 1.0 / 64);
}

TEST(PipelinePlan, MicroBatchCountsAreChecked) {
  EXPECT_EQ(parseMicroBatches("auto", 64), kAutoMicroBatches);
  EXPECT_EQ(parseMicroBatches("8", 64), 8);
  EXPECT_EQ(parseMicroBatches("64", 64), 64);
  auto message = [](const std::string& text, int64_t batch) {
    try {
      parseMicroBatches(text, batch);
    } catch (const InvalidArgument& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(message("0", 64).find("--micro-batches 0: a batch needs at least 1 micro-batch"), std::string::npos);
  EXPECT_NE(message("-2", 64).find("at least 1 micro-batch"), std::string::npos);
  EXPECT_NE(message("four", 64).find("--micro-batches 'four' is not a number"), std::string::npos);
  EXPECT_NE(message("4x", 64).find("is not a number"), std::string::npos);
  EXPECT_NE(message("", 64).find("is not a number"), std::string::npos);
  EXPECT_NE(message("65", 64).find("--micro-batches 65 is more than --batch 64"), std::string::npos);
}

// Two layers of 1 ms per example each on a batch of 64.
MicroBatchCosts twoLayers(double perMicroBatch, double message) {
  return {.perMicroBatch = {perMicroBatch / 2, perMicroBatch / 2}, .perExample = {1e-3, 1e-3}, .messageSeconds = message};
}

TEST(PipelinePlan, AutoMicroBatchesTradesTheBubbleAgainstFixedCosts) {
  // Nothing paid per micro-batch: one example per micro-batch leaves the smallest bubble.
  EXPECT_EQ(chooseMicroBatches(twoLayers(0, 0), 64, 2, {}).microBatches, 64);
  // Fixed costs far above the work: one micro-batch.
  EXPECT_EQ(chooseMicroBatches(twoLayers(1.0, 1.0), 64, 2, {}).microBatches, 1);
  // One stage has no bubble to fill: any fixed cost makes M = 1 best.
  EXPECT_EQ(chooseMicroBatches(twoLayers(1e-4, 0), 64, 1, {}).microBatches, 1);
  // 32 ms of work per stage and 1 ms fixed per micro-batch: about sqrt((S-1) W / F) = 5.7,
  // with each micro-batch's work at least M/(S-1) times its fixed cost.
  const MicroBatchChoice c = chooseMicroBatches(twoLayers(0.5e-3, 0.5e-3), 64, 2, {});
  EXPECT_GE(c.microBatches, 4);
  EXPECT_LE(c.microBatches, 8);
  EXPECT_EQ(c.counts, (std::vector<int>{1, 1}));
  EXPECT_NEAR(c.fixedSeconds, 0.75e-3, 1e-12);  // the slowest stage's overhead and the messages
  const double work = c.slotSeconds - c.fixedSeconds;
  EXPECT_GE(work, double(c.microBatches) / 2 * c.fixedSeconds);
  // A fixed cut is kept.
  EXPECT_EQ(chooseMicroBatches(twoLayers(0, 0), 64, 1, {2}).counts, (std::vector<int>{2}));
}

}  // namespace
}  // namespace cohort::pipeline_plan_test
