// A process killed with SIGKILL while it writes checkpoints leaves every complete checkpoint
// whole: the newest file that exists always verifies.
#include <cohort/checkpoint.h>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <random>

#include "test_util.h"

namespace cohort::checkpoint_kill_test {
namespace {

constexpr size_t kPayload = 8 << 20;  // big enough that a kill often lands mid-write

std::vector<uint8_t> payloadFor(int64_t step) {
  std::vector<uint8_t> p(kPayload);
  for (size_t i = 0; i < p.size(); ++i) p[i] = uint8_t((i >> 3) + size_t(step));
  return p;
}

TEST(CheckpointKill, KillAtAnyMomentLeavesTheNewestWhole) {
  std::mt19937 rng(12345);
  for (int round = 0; round < 8; ++round) {
    test::TempDir dir;
    int ready[2];
    ASSERT_EQ(::pipe(ready), 0);
    const pid_t child = ::fork();
    ASSERT_GE(child, 0);
    if (child == 0) {
      ::close(ready[0]);
      CheckpointStore store(dir.path());
      for (int64_t step = 1;; ++step) {
        store.save(step, payloadFor(step));
        const char byte = 1;
        if (::write(ready[1], &byte, 1) != 1) ::_exit(3);
      }
    }
    ::close(ready[1]);
    // Wait for a few complete saves, then kill somewhere inside a later one.
    const int saves = 2 + round % 3;
    for (int i = 0; i < saves; ++i) {
      char byte;
      ASSERT_EQ(::read(ready[0], &byte, 1), 1);
    }
    // A random moment, not a synchronization: the writer is in some save or other (it saves without
    // pause), and any moment must leave the newest checkpoint whole.
    ::usleep(std::uniform_int_distribution<int>(0, 30000)(rng));
    ::kill(child, SIGKILL);
    int status = 0;
    ::waitpid(child, &status, 0);
    ::close(ready[0]);
    ASSERT_TRUE(WIFSIGNALED(status));

    CheckpointStore store(dir.path());  // removes the killed writer's temporary file
    for (const auto& entry : std::filesystem::directory_iterator(dir.path())) {
      EXPECT_EQ(entry.path().string().find(".tmp."), std::string::npos) << entry.path();
    }
    std::vector<std::string> corrupt;
    auto loaded = store.loadNewest([&](const std::string& m) { corrupt.push_back(m); });
    ASSERT_TRUE(loaded.has_value()) << "round " << round;
    EXPECT_TRUE(corrupt.empty()) << corrupt.front();
    EXPECT_GE(loaded->file.step, saves);
    EXPECT_EQ(loaded->payload, payloadFor(loaded->file.step)) << "round " << round;
  }
}

}  // namespace
}  // namespace cohort::checkpoint_kill_test
