// base/subprocess.h: exit statuses, signals, output capture, environment, exec failures, a
// deadline that ends in killing the group, and no zombie left behind.
#include "base/subprocess.h"

#include <gtest/gtest.h>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>

namespace cohort {
namespace {

using namespace std::chrono_literals;

IoClock::time_point in(std::chrono::milliseconds ms) { return IoClock::now() + ms; }

SubprocessOptions program(std::vector<std::string> argv) {
  SubprocessOptions options;
  options.argv = std::move(argv);
  return options;
}

SubprocessOptions shell(const std::string& script) { return program({"sh", "-c", script}); }

// The child's stdout (and stderr with it) until it closes it, then its status.
std::pair<std::string, ExitStatus> capture(SubprocessOptions options) {
  options.out = ChildStream::pipe();
  options.err = ChildStream::sameAsStdout();
  Subprocess child = Subprocess::spawn(options);
  std::string out;
  EXPECT_EQ(child.readOutput(out, in(10s), 1 << 20), IoStatus::kClosed);
  return {out, child.wait()};
}

TEST(Subprocess, ExitStatus) {
  const ExitStatus status = Subprocess::spawn(shell("exit 3")).wait();
  EXPECT_TRUE(status.exited());
  EXPECT_EQ(status.code(), 3);
  EXPECT_FALSE(status.ok());
  EXPECT_EQ(status.shellCode(), 3);
  EXPECT_TRUE(Subprocess::spawn(shell("exit 0")).wait().ok());
}

TEST(Subprocess, KilledBySignal) {
  const ExitStatus status = Subprocess::spawn(shell("kill -TERM $$")).wait();
  EXPECT_TRUE(status.signaled());
  EXPECT_EQ(status.signal(), SIGTERM);
  EXPECT_EQ(status.shellCode(), 128 + SIGTERM);
  EXPECT_EQ(signalName(SIGTERM), "SIGTERM");
}

// `exec`: the child is sleep itself. A shell that forked it would leave an orphaned sleep holding
// the test's stdout when killed, and ctest would wait the 30 s for it (it did, under load).
TEST(Subprocess, SignalReachesTheChild) {
  Subprocess child = Subprocess::spawn(shell("exec sleep 30"));
  EXPECT_FALSE(child.tryWait());
  child.signal(SIGKILL);
  EXPECT_EQ(child.wait().signal(), SIGKILL);
  EXPECT_FALSE(child.running());
}

TEST(Subprocess, CapturesStdoutAndStderr) {
  const auto [out, status] = capture(shell("echo out; echo err >&2"));
  EXPECT_EQ(out, "out\nerr\n");
  EXPECT_TRUE(status.ok());
}

TEST(Subprocess, StdinPipeStartsWithItsInput) {
  SubprocessOptions options = program({"cat"});
  options.in = ChildStream::pipe("hello\n");
  options.out = ChildStream::pipe();
  Subprocess child = Subprocess::spawn(options);
  child.closeFd(STDIN_FILENO);  // cat ends at this end of file
  std::string out;
  EXPECT_EQ(child.readOutput(out, in(10s), 1 << 20), IoStatus::kClosed);
  EXPECT_EQ(out, "hello\n");
  EXPECT_TRUE(child.wait().ok());
}

TEST(Subprocess, ExtraDescriptor) {
  SubprocessOptions options = shell("echo channel >&3");
  options.extra = {{3, ChildStream::pipe()}};
  Subprocess child = Subprocess::spawn(options);
  std::string out;
  EXPECT_EQ(child.readOutput(out, in(10s), 1 << 20, 3), IoStatus::kClosed);
  EXPECT_EQ(out, "channel\n");
  EXPECT_TRUE(child.wait().ok());
}

TEST(Subprocess, OutputReadStopsAtItsLimit) {
  SubprocessOptions options = program({"yes"});
  options.out = ChildStream::pipe();
  Subprocess child = Subprocess::spawn(options);
  std::string out;
  EXPECT_EQ(child.readOutput(out, in(10s), 10000), IoStatus::kOk);
  EXPECT_EQ(out.size(), 10000u);
  out.clear();
  EXPECT_EQ(child.readSome(out, in(10s)), IoStatus::kOk);
  EXPECT_GT(out.size(), 0u);
}  // `yes` never ends: the destructor kills it

TEST(Subprocess, EnvironmentChanges) {
  ::setenv("COHORT_SUBPROCESS_TEST_A", "parent", 1);
  ::setenv("COHORT_SUBPROCESS_TEST_GONE_1", "1", 1);
  ::setenv("COHORT_SUBPROCESS_TEST_KEPT", "kept", 1);
  SubprocessOptions options =
      shell("echo \"$COHORT_SUBPROCESS_TEST_A ${COHORT_SUBPROCESS_TEST_GONE_1-unset} $COHORT_SUBPROCESS_TEST_KEPT\"");
  options.setEnv = {{"COHORT_SUBPROCESS_TEST_A", "child"}};
  options.unsetEnv = {"COHORT_SUBPROCESS_TEST_GONE*"};
  EXPECT_EQ(capture(options).first, "child unset kept\n");
}

TEST(Subprocess, ExecFailureThrows) {
  try {
    Subprocess::spawn(program({"/nonexistent/cohort-no-such-program"}));
    FAIL() << "spawn did not throw";
  } catch (const SubprocessError& e) {
    EXPECT_EQ(std::string(e.what()), "cannot run /nonexistent/cohort-no-such-program: No such file or directory");
  }
}

TEST(Subprocess, ExecFailureSaidByTheChild) {
  SubprocessOptions options = program({"/nonexistent/cohort-no-such-program"});
  options.execFailurePrefix = "tool: ";
  const auto [out, status] = capture(options);
  EXPECT_EQ(out, "tool: cannot run /nonexistent/cohort-no-such-program: No such file or directory\n");
  EXPECT_EQ(status.code(), 127);
}

TEST(Subprocess, TimeoutKillsTheGroup) {
  // The shell's background sleep holds the output pipe too: it closes only when the whole group is gone.
  SubprocessOptions options = shell("sleep 30 & sleep 30; wait");
  options.out = ChildStream::pipe();
  options.processGroup = kNewGroup;
  Subprocess child = Subprocess::spawn(options);
  const auto start = IoClock::now();
  EXPECT_FALSE(child.waitUntil(in(200ms)));
  EXPECT_GE(IoClock::now() - start, 200ms);
  child.signalGroup(SIGKILL);
  EXPECT_EQ(child.wait().signal(), SIGKILL);
  std::string out;
  EXPECT_EQ(child.readOutput(out, in(10s), 1 << 20), IoStatus::kClosed);  // every writer is gone
  EXPECT_LT(IoClock::now() - start, 5s);
}

TEST(Subprocess, WaitUntilSeesTheExit) {
  Subprocess child = Subprocess::spawn(shell("exit 5"));
  const auto status = child.waitUntil(in(10s));
  ASSERT_TRUE(status);
  EXPECT_EQ(status->code(), 5);
}

TEST(Subprocess, NoZombieLeft) {
  pid_t pid = -1;
  {
    Subprocess child = Subprocess::spawn(shell("sleep 30"));
    pid = child.pid();
    Subprocess moved = std::move(child);  // the handle moves; the child stays one
    EXPECT_EQ(moved.pid(), pid);
    EXPECT_FALSE(child.running());
  }
  // Killed and reaped by the destructor: no such child any more, not even a zombie.
  EXPECT_EQ(::waitpid(pid, nullptr, WNOHANG), -1);
  EXPECT_EQ(errno, ECHILD);
  EXPECT_EQ(::kill(pid, 0), -1);
}

TEST(Subprocess, ForkRunsAFunction) {
  EXPECT_EQ(Subprocess::fork([] { return 7; }).wait().code(), 7);
  EXPECT_EQ(Subprocess::fork([]() -> int { throw std::runtime_error("no"); }).wait().code(), 1);
}

}  // namespace
}  // namespace cohort
