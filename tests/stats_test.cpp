// base/stats.h.
#include "base/stats.h"

#include <gtest/gtest.h>

namespace cohort {
namespace {

TEST(Median, IsTheMiddleOfAnOddCount) {
  EXPECT_EQ(median({3.0, 1.0, 2.0}), 2.0);
  EXPECT_EQ(median({5.0}), 5.0);
}

TEST(Median, IsTheUpperMiddleOfAnEvenCount) {
  EXPECT_EQ(median({4.0, 1.0, 3.0, 2.0}), 3.0);  // a value measured, not the mean 2.5
  EXPECT_EQ(median({2.0, 1.0}), 2.0);
}

TEST(Median, IsZeroForNone) { EXPECT_EQ(median({}), 0.0); }

TEST(Median, IgnoresOutliersAndRepeats) {
  EXPECT_EQ(median({1.0, 1.0, 1.0, 1e9, -1e9}), 1.0);
}

}  // namespace
}  // namespace cohort
