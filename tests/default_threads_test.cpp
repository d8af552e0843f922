// The default intra-op thread count (base/compute_threads.h): the host's idle cores, shared.
#include "base/compute_threads.h"

#include <gtest/gtest.h>

#include <sched.h>

#include <algorithm>
#include <atomic>
#include <thread>
#include <vector>

namespace cohort {
namespace {

int coresHere() {
  cpu_set_t mask;
  CPU_ZERO(&mask);
  EXPECT_EQ(::sched_getaffinity(0, sizeof(mask), &mask), 0);
  return CPU_COUNT(&mask);
}

TEST(ComputeThreads, IdleCoresAreAShareOfTheAllowedOnes) {
  const auto idle = idleCores(std::chrono::milliseconds(50));
  ASSERT_TRUE(idle.has_value()) << "/proc/stat could not be read";
  EXPECT_GE(*idle, 0.0);
  EXPECT_LE(*idle, coresHere() + 1e-9);
  for (int processes : {1, 2, 3}) {
    const int threads = defaultComputeThreads(processes);
    EXPECT_GE(threads, 1);
    EXPECT_LE(threads, std::max(1, coresHere() / processes)) << processes << " processes";
  }
}

// Every allowed core kept busy (as by neighbours): no core is idle, and the default is one thread,
// not one per core that would wait for its time slice in every parallel region.
TEST(ComputeThreads, BesideEveryCoreBusyTheDefaultIsOneThread) {
  std::atomic<bool> stop{false};
  std::vector<std::thread> spinners;
  for (int i = 0; i < coresHere(); ++i) {
    spinners.emplace_back([&stop] {
      while (!stop.load(std::memory_order_relaxed)) {
      }
    });
  }
  const auto idle = idleCores(std::chrono::milliseconds(100));
  const int threads = defaultComputeThreads(1);
  stop = true;
  for (auto& t : spinners) t.join();
  ASSERT_TRUE(idle.has_value());
  EXPECT_LT(*idle, 0.75) << "every core was spinning";
  EXPECT_EQ(threads, 1);
}

}  // namespace
}  // namespace cohort
