// The watchdog that bounds the NCCL works the host does not wait for (comm/work_watchdog.h), on
// works of its own making: it needs no GPU to show what it does with a work that completes, fails
// or never ends.
#include "comm/work_watchdog.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <atomic>
#include <chrono>
#include <thread>
#include <stdexcept>

namespace cohort::work_watchdog_test {
namespace {

using namespace std::chrono_literals;

// The thread aborts a failed work just after it records the failure (which wakes drain()).
bool abortedSoon(const std::atomic<bool>& aborted) {
  const auto until = std::chrono::steady_clock::now() + 10s;
  while (!aborted && std::chrono::steady_clock::now() < until) std::this_thread::yield();
  return aborted;
}

// Completes after it has been asked `polls` times (never, for -1), with `error` if one is set.
class ScriptedWork : public c10d::Work {
 public:
  explicit ScriptedWork(int polls, std::exception_ptr error = nullptr) : polls_(polls), error_(std::move(error)) {}
  bool isCompleted() override {
    if (polls_ < 0) return false;
    return asked_.fetch_add(1) + 1 >= polls_;
  }
  std::exception_ptr exception() const override { return error_; }
  void abort() override { aborted = true; }
  std::atomic<bool> aborted{false};

 private:
  const int polls_;
  std::atomic<int> asked_{0};
  const std::exception_ptr error_;
};

TEST(WorkWatchdog, CompletedWorksAreLetGoWithTheirTensors) {
  WorkWatchdog watchdog(10s, 100us);
  auto tensor = torch::zeros({4});
  auto first = c10::make_intrusive<ScriptedWork>(3);
  auto second = c10::make_intrusive<ScriptedWork>(5);
  watchdog.watch(first, "allreduce of 16 bytes", {tensor});
  watchdog.watch(second, "allreduce of 16 bytes", {tensor});
  EXPECT_GE(tensor.use_count(), 2);
  EXPECT_FALSE(watchdog.drain().has_value());
  EXPECT_EQ(watchdog.watching(), 0u);
  EXPECT_EQ(tensor.use_count(), 1);  // the watchdog held it until the works completed, and no longer
  EXPECT_FALSE(first->aborted);
  EXPECT_FALSE(watchdog.failure().has_value());
}

TEST(WorkWatchdog, AWorkThatOutlivesTheTimeoutIsAbortedAndReported) {
  WorkWatchdog watchdog(50ms, 100us);
  auto stuck = c10::make_intrusive<ScriptedWork>(-1);
  watchdog.watch(stuck, "allreduce of 4096 bytes", {torch::zeros({1024})});
  const auto failed = watchdog.drain();
  ASSERT_TRUE(failed.has_value());
  EXPECT_EQ(failed->op, "allreduce of 4096 bytes");
  EXPECT_NE(failed->what.find("within 50 ms (timed out)"), std::string::npos) << failed->what;
  EXPECT_TRUE(abortedSoon(stuck->aborted));
  ASSERT_TRUE(watchdog.failure().has_value());
  // Its communicator is aborted: a later work is not watched.
  watchdog.watch(c10::make_intrusive<ScriptedWork>(1), "broadcast", {});
  EXPECT_EQ(watchdog.watching(), 0u);
}

TEST(WorkWatchdog, AFailedWorkIsReportedWithItsErrorAndTheOnesAfterItAreDropped) {
  WorkWatchdog watchdog(10s, 100us);
  auto ok = c10::make_intrusive<ScriptedWork>(1);
  auto broken = c10::make_intrusive<ScriptedWork>(2, std::make_exception_ptr(std::runtime_error("NCCL error: remote process exited")));
  auto after = c10::make_intrusive<ScriptedWork>(-1);
  watchdog.watch(ok, "allreduce of 8 bytes", {});
  watchdog.watch(broken, "allreduce of 16 bytes", {});
  watchdog.watch(after, "allreduce of 32 bytes", {});
  const auto failed = watchdog.drain();
  ASSERT_TRUE(failed.has_value());
  EXPECT_EQ(failed->op, "allreduce of 16 bytes");
  EXPECT_EQ(failed->what, "NCCL error: remote process exited");
  EXPECT_TRUE(abortedSoon(broken->aborted));
  EXPECT_FALSE(ok->aborted);
  EXPECT_EQ(watchdog.watching(), 0u);
}

TEST(WorkWatchdog, ADestroyedWatchdogStopsWithWorksStillRunning) {
  auto stuck = c10::make_intrusive<ScriptedWork>(-1);
  {
    WorkWatchdog watchdog(60s, 100us);
    watchdog.watch(stuck, "allreduce", {});
    EXPECT_EQ(watchdog.watching(), 1u);
  }
  EXPECT_FALSE(stuck->aborted);  // the group's shutdown finishes it, not the watchdog
}

}  // namespace
}  // namespace cohort::work_watchdog_test
