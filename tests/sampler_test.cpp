#include <cohort/error.h>
#include <cohort/job.h>
#include <cohort/sampler.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <set>

namespace cohort::sampler_test {
namespace {

TEST(Sampler, ShardsAreDisjointAndCoverWhenDivisible) {
  for (int world : {1, 2, 3}) {
    const int64_t n = 600;
    std::set<int64_t> seen;
    for (int rank = 0; rank < world; ++rank) {
      ShardSampler s({.datasetSize = n, .rank = rank, .worldSize = world, .seed = 7});
      auto idx = s.epochIndices(0);
      EXPECT_EQ(int64_t(idx.size()), n / world);
      for (int64_t i : idx) {
        EXPECT_TRUE(seen.insert(i).second) << "index " << i << " given to two ranks";
        EXPECT_GE(i, 0);
        EXPECT_LT(i, n);
      }
    }
    EXPECT_EQ(int64_t(seen.size()), n) << "world " << world;
  }
}

TEST(Sampler, LeftoversAreFewerThanWorldAndRotate) {
  const int64_t n = 101;
  const int world = 3;
  std::set<int64_t> leftOut[2];
  for (int epoch = 0; epoch < 2; ++epoch) {
    std::set<int64_t> seen;
    for (int rank = 0; rank < world; ++rank) {
      ShardSampler s({.datasetSize = n, .rank = rank, .worldSize = world, .seed = 3});
      for (int64_t i : s.epochIndices(epoch)) EXPECT_TRUE(seen.insert(i).second);
    }
    EXPECT_EQ(int64_t(seen.size()), n - n % world);
    for (int64_t i = 0; i < n; ++i) {
      if (!seen.count(i)) leftOut[epoch].insert(i);
    }
  }
  EXPECT_EQ(leftOut[0].size(), 2u);
  EXPECT_NE(leftOut[0], leftOut[1]);
}

TEST(Sampler, OrderDependsOnSeedAndEpochOnly) {
  ShardSampler a({.datasetSize = 1000, .rank = 1, .worldSize = 2, .seed = 11});
  ShardSampler b({.datasetSize = 1000, .rank = 1, .worldSize = 2, .seed = 11});
  ShardSampler c({.datasetSize = 1000, .rank = 1, .worldSize = 2, .seed = 12});
  EXPECT_EQ(a.epochIndices(4), b.epochIndices(4));
  EXPECT_NE(a.epochIndices(4), a.epochIndices(5));
  EXPECT_NE(a.epochIndices(4), c.epochIndices(4));
}

// Batch k of every rank together is batch k of one process with world times the batch.
TEST(Sampler, RanksTogetherFormTheSingleProcessBatch) {
  const int64_t n = 240, b = 4;
  for (int world : {2, 3}) {
    ShardSampler single({.datasetSize = n, .rank = 0, .worldSize = 1, .seed = 9});
    auto all = single.epochIndices(2);
    for (int64_t k = 0; k < 5; ++k) {
      std::multiset<int64_t> together;
      for (int rank = 0; rank < world; ++rank) {
        ShardSampler s({.datasetSize = n, .rank = rank, .worldSize = world, .seed = 9});
        auto mine = s.epochIndices(2);
        together.insert(mine.begin() + k * b, mine.begin() + (k + 1) * b);
      }
      std::multiset<int64_t> expected(all.begin() + k * b * world, all.begin() + (k + 1) * b * world);
      EXPECT_EQ(together, expected) << "world " << world << " batch " << k;
    }
  }
}

TEST(Sampler, UnshuffledIsInOrder) {
  ShardSampler s({.datasetSize = 10, .rank = 1, .worldSize = 2, .seed = 0, .shuffle = false});
  EXPECT_EQ(s.epochIndices(0), (std::vector<int64_t>{1, 3, 5, 7, 9}));
  EXPECT_EQ(s.batchesPerEpoch(2), 3);
}

TEST(Sampler, RejectsBadRanks) {
  EXPECT_THROW(ShardSampler({.datasetSize = 10, .rank = 2, .worldSize = 2}), InvalidArgument);
  EXPECT_THROW(ShardSampler({.datasetSize = 10, .rank = 0, .worldSize = 0}), InvalidArgument);
  EXPECT_THROW(ShardSampler({.datasetSize = 1, .rank = 0, .worldSize = 2}), InvalidArgument);
}

// A batch size below 1 is refused by name: it divided by zero (SIGFPE) before.
TEST(Sampler, BatchesOfNoExamplesAreRefused) {
  ShardSampler s({.datasetSize = 10, .rank = 0, .worldSize = 1});
  EXPECT_THROW(s.batchesPerEpoch(0), InvalidArgument);
  EXPECT_THROW(s.batchesPerEpoch(-3), InvalidArgument);
  DistributedSampler sampler(100, Job::single(), 1);
  try {
    sampler.batches(0);
    FAIL() << "no error for batches(0)";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("at least 1 example, got 0"), std::string::npos) << e.what();
  }
  EXPECT_EQ(sampler.batches(32), 4);
}

}  // namespace
}  // namespace cohort::sampler_test
