// `cohort launch`: the environment every rank gets, output prefixed line by line, the first failure
// stopping the others with its status, signals forwarded, bad input rejected.
#include <arpa/inet.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <map>
#include <regex>
#include <set>
#include <thread>

#include "comm/store.h"
#include "test_util.h"

#include <nlohmann/json.hpp>

namespace cohort::launch_test {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::seconds;

std::string launch(const std::string& args) { return test::cohortBinary() + " launch " + args; }

// The shell commands below listen on nothing. With a --port every rank starts at once; without one
// the launcher would wait for rank 0 to tell the port it listens on (or to exit).
constexpr int kAnyPort = 29400;
const std::string kWithPort = " --port " + std::to_string(kAnyPort);

size_t count(const std::string& text, const std::string& needle) {
  size_t n = 0;
  for (size_t at = text.find(needle); at != std::string::npos; at = text.find(needle, at + needle.size())) ++n;
  return n;
}

// The launcher started from the test with fork/exec: stdout and stderr captured apart, in a process
// group of its own so that cleanup kills whatever it started, every wait bounded by a deadline.
class LauncherProcess {
 public:
  // nonBlockingStdout: the launcher's standard output is a non-blocking pipe of one page, as a CI
  // runner may leave it, which the test reads no faster than it gets to.
  explicit LauncherProcess(const std::vector<std::string>& argv, bool nonBlockingStdout = false) {
    int out[2];
    int err[2];
    if (::pipe2(out, O_CLOEXEC) != 0 || ::pipe2(err, O_CLOEXEC) != 0) throw std::runtime_error("pipe failed");
    if (nonBlockingStdout && (::fcntl(out[1], F_SETPIPE_SZ, 4096) < 0 ||
                              ::fcntl(out[1], F_SETFL, ::fcntl(out[1], F_GETFL) | O_NONBLOCK) != 0)) {
      throw std::runtime_error("cannot make the pipe small and non-blocking");
    }
    std::vector<std::string> args = argv;
    std::vector<char*> raw;
    for (auto& a : args) raw.push_back(a.data());
    raw.push_back(nullptr);
    pid_ = ::fork();
    if (pid_ < 0) throw std::runtime_error("fork failed");
    if (pid_ == 0) {
      ::setpgid(0, 0);
      ::dup2(out[1], STDOUT_FILENO);
      ::dup2(err[1], STDERR_FILENO);
      ::execvp(raw[0], raw.data());
      ::_exit(127);
    }
    ::setpgid(pid_, pid_);  // also here: no race with the kill in the destructor
    ::close(out[1]);
    ::close(err[1]);
    outFd_ = out[0];
    errFd_ = err[0];
    pidFd_ = int(::syscall(SYS_pidfd_open, pid_, 0));  // readable once the launcher exits
    if (pidFd_ < 0) throw std::runtime_error("pidfd_open failed");
  }

  ~LauncherProcess() {
    if (!reaped_) {
      ::kill(-pid_, SIGKILL);  // the launcher and its children, should a test have failed early
      ::waitpid(pid_, nullptr, 0);
    }
    for (int fd : {outFd_, errFd_, pidFd_}) {
      if (fd >= 0) ::close(fd);
    }
  }

  pid_t pid() const { return pid_; }
  // Whether the launcher has not exited yet.
  bool running() const {
    pollfd p{pidFd_, POLLIN, 0};
    return !exited_ && ::poll(&p, 1, 0) == 0;
  }
  const std::string& out() const { return out_; }
  const std::string& err() const { return err_; }

  // Reads output until stdout holds `needle` `times` times; false at the deadline.
  bool waitForOutput(const std::string& needle, size_t times, seconds timeout) {
    const auto deadline = Clock::now() + timeout;
    while (count(out_, needle) < times) {
      if (!pump(deadline)) return false;
    }
    return true;
  }

  // Reads output until stderr (the launcher's own lines) holds `needle`; false at the deadline.
  bool waitForError(const std::string& needle, seconds timeout) {
    const auto deadline = Clock::now() + timeout;
    while (count(err_, needle) < 1) {
      if (!pump(deadline)) return false;
    }
    return true;
  }

  // Reads all output and reaps the launcher; its exit code (128 + signal when killed), -1 at the
  // deadline.
  int wait(seconds timeout) {
    const auto deadline = Clock::now() + timeout;
    while (outFd_ >= 0 || errFd_ >= 0 || !exited_) {
      if (!pump(deadline)) return -1;
    }
    int status = 0;
    ::kill(-pid_, SIGKILL);       // anything a rank left behind; the group lives while its leader is a zombie
    ::waitpid(pid_, &status, 0);  // it has exited: does not block
    reaped_ = true;
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  }

 private:
  // One round of waiting for output or the exit; false when the deadline passed.
  bool pump(Clock::time_point deadline) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    if (left <= 0) return false;
    std::vector<pollfd> fds{{pidFd_, POLLIN, 0}, {outFd_, POLLIN, 0}, {errFd_, POLLIN, 0}};
    if (::poll(fds.data(), fds.size(), int(left)) < 0 && errno != EINTR) return false;
    if (fds[0].revents != 0) exited_ = true;
    readFrom(outFd_, out_, fds[1].revents);
    readFrom(errFd_, err_, fds[2].revents);
    return true;
  }

  static void readFrom(int& fd, std::string& into, short revents) {
    if (fd < 0 || revents == 0) return;
    char buffer[65536];
    const ssize_t n = ::read(fd, buffer, sizeof(buffer));
    if (n > 0) {
      into.append(buffer, size_t(n));
    } else if (n == 0 || errno != EINTR) {
      ::close(fd);
      fd = -1;
    }
  }

  pid_t pid_ = -1;
  int outFd_ = -1;
  int errFd_ = -1;
  int pidFd_ = -1;
  bool exited_ = false;
  bool reaped_ = false;
  std::string out_;
  std::string err_;
};

int threadsPerRank(int n) { return std::max(1, int(std::max(1u, std::thread::hardware_concurrency())) / n); }

// Variables of other launchers in the launcher's environment must not reach the ranks.
const char* kForeignRanks = "RANK=5 WORLD_SIZE=9 LOCAL_RANK=4 OMPI_COMM_WORLD_RANK=3 OMPI_COMM_WORLD_SIZE=9 "
                            "SLURM_PROCID=2 TF_CONFIG='{\"task\":{}}' ";

class LaunchWorldSize : public testing::TestWithParam<int> {};

TEST_P(LaunchWorldSize, EveryRankGetsItsEnvironmentAndItsPrefix) {
  const int n = GetParam();
  const int port = kAnyPort;  // an explicit --port is passed on as it is
  auto r = test::runCommand(
      std::string("env -u OMP_NUM_THREADS -u OPENBLAS_NUM_THREADS ") + kForeignRanks +
          launch("-n " + std::to_string(n) + " --port " + std::to_string(port) +
                 " -- sh -c 'echo \"env $RANK $WORLD_SIZE $LOCAL_RANK $LOCAL_WORLD_SIZE $MASTER_ADDR $MASTER_PORT "
                 "$OMP_NUM_THREADS $OPENBLAS_NUM_THREADS ${OMPI_COMM_WORLD_RANK-none} ${OMPI_COMM_WORLD_SIZE-none} "
                 "${SLURM_PROCID-none} ${TF_CONFIG-none}\"'"),
      60);
  ASSERT_EQ(r.exitCode, 0) << r.output;
  const auto lines = test::lines(r.output);
  EXPECT_EQ(lines.size(), size_t(n)) << r.output;
  // The threads: the host's idle cores when launch started, shared (base/compute_threads.h), so
  // from 1 to the cores / n, the same for every rank, and OpenBLAS's equal to OpenMP's.
  std::set<int> threadCounts;
  for (int rank = 0; rank < n; ++rank) {
    const std::string i = std::to_string(rank);
    bool found = false;
    for (int t = 1; t <= threadsPerRank(n) && !found; ++t) {
      const std::string threads = std::to_string(t);
      const std::string expected = "[rank " + i + "] env " + i + " " + std::to_string(n) + " " + i + " " +
                                   std::to_string(n) + " 127.0.0.1 " + std::to_string(port) + " " + threads + " " +
                                   threads + " none none none none";
      if (std::find(lines.begin(), lines.end(), expected) != lines.end()) {
        found = true;
        threadCounts.insert(t);
      }
    }
    EXPECT_TRUE(found) << "rank " << i << "'s line, with 1 to " << threadsPerRank(n) << " threads, in:\n" << r.output;
  }
  EXPECT_LE(threadCounts.size(), 1u) << r.output;
}

INSTANTIATE_TEST_SUITE_P(LaunchWorldSizes, LaunchWorldSize, testing::Values(1, 2, 3));

TEST(Launch, KeepsTheUsersThreadBudget) {
  auto r = test::runCommand("env OMP_NUM_THREADS=3 OPENBLAS_NUM_THREADS=2 " +
                                launch("-n 2 -- sh -c 'echo \"threads $OMP_NUM_THREADS $OPENBLAS_NUM_THREADS\"'"),
                            60);
  ASSERT_EQ(r.exitCode, 0) << r.output;
  EXPECT_EQ(count(r.output, "] threads 3 2\n"), 2u) << r.output;
}

// Without --port, rank 0 starts alone with MASTER_PORT=0 (it binds a port of its choosing) and the
// others once it has told that port on its channel: they get it as MASTER_PORT.
TEST(Launch, PortZeroStartsTheOthersWithThePortRankZeroTells) {
  auto r = test::runCommand(
      launch("-n 3 --host localhost -- sh -c 'if [ $RANK = 0 ]; then echo port 4321 >&3; fi; "
             "echo \"rank $RANK addr $MASTER_ADDR port $MASTER_PORT\"'"),
      60);
  ASSERT_EQ(r.exitCode, 0) << r.output;
  EXPECT_NE(r.output.find("[rank 0] rank 0 addr localhost port 0\n"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("[rank 1] rank 1 addr localhost port 4321\n"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("[rank 2] rank 2 addr localhost port 4321\n"), std::string::npos) << r.output;
  // "port none" (a chief that listens on nothing) starts them too, with port 0, while it runs.
  r = test::runCommand(launch("-n 2 -- sh -c 'if [ $RANK = 0 ]; then echo port none >&3; exec sleep 60; fi; "
                              "echo \"rank $RANK port $MASTER_PORT\"; exit 3'"),
                       60);
  EXPECT_EQ(r.exitCode, 3) << r.output;
  EXPECT_NE(r.output.find("[rank 1] rank 1 port 0\n"), std::string::npos) << r.output;
}

// Rank 1 fails first (status 1, as a rank that lost a peer does); rank 0, asked to stop, then exits
// with 2, as a rank that refused its input does: the refusal is the cause, so the job ends with 2.
TEST(Launch, ARefusedInputDuringTheEndIsTheJobsStatus) {
  auto r = test::runCommand(launch("-n 2 -- sh -c 'if [ $RANK = 0 ]; then echo port none >&3; "
                                   "trap \"exit 2\" TERM; while :; do sleep 0.05; done; fi; exit 1'"),
                            60);
  EXPECT_EQ(r.exitCode, 2) << r.output;
  EXPECT_NE(r.output.find("rank 1 exited with status 1"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("rank 0 exited with status 2"), std::string::npos) << r.output;
}

// A rank 0 that takes its time to tell its port: after a few seconds the launcher says whom it is
// waiting for and what a program that never tells needs; the others start once rank 0 has told
// (here only after the test saw that line: rank 0 reads a FIFO the test writes then).
TEST(Launch, SaysWhomItWaitsForBeforeRankZeroTellsItsPort) {
  test::TempDir dir;
  const std::string fifo = dir.file("fifo");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  LauncherProcess p({test::cohortBinary(), "launch", "-n", "2", "--", "sh", "-c",
                     "if [ $RANK = 0 ]; then read x < " + fifo + "; echo port none >&3; fi; echo started-$RANK"});
  ASSERT_TRUE(p.waitForError("cohort launch: waiting for rank 0 to tell the port it listens on before starting the "
                             "others (120 s at most); a program that does not write \"port P\" on COHORT_LAUNCH_FD "
                             "needs --port P\n",
                             seconds(60)))
      << p.out() << p.err();
  EXPECT_EQ(count(p.out(), "started-"), 0u) << "rank 1 started before rank 0 told its port\n" << p.out();
  test::writeFile(fifo, "go\n");
  EXPECT_EQ(p.wait(seconds(60)), 0) << p.out() << p.err();
  EXPECT_NE(p.out().find("[rank 0] started-0\n"), std::string::npos) << p.out();
  EXPECT_NE(p.out().find("[rank 1] started-1\n"), std::string::npos) << p.out();
}

// --ps M: M more children, and every one gets the same TF_CONFIG cluster with its own task, and
// the same job secret.
TEST(Launch, ParameterServersGetTfConfigAndTheJobsSecret) {
  // The shards start first and tell their ports (here 20000 + k), then the chief, which tells
  // its own (4242), then the other worker: each TF_CONFIG holds the ports told before it started.
  auto r = test::runCommand(
      "env -u COHORT_AUTH_TOKEN " +
          launch("-n 2 --ps 2 -- sh -c 'if [ -z \"$RANK\" ]; then case \"$TF_CONFIG\" in *index\\\":0*) p=20000;; *) p=20001;; esac; "
                 "echo port $p >&3; "
                 "elif [ $RANK = 0 ]; then echo port 4242 >&3; fi; echo \"${RANK-none} ${COHORT_AUTH_TOKEN} $TF_CONFIG\"'"),
      60);
  ASSERT_EQ(r.exitCode, 0) << r.output;
  const std::regex line(R"(\[(rank|ps) (\d)\] (\S+) (\S+) (.*))");
  std::set<std::string> tokens, tasks;
  std::map<std::string, nlohmann::json> clusters;
  for (const auto& l : test::lines(r.output)) {
    std::smatch m;
    ASSERT_TRUE(std::regex_match(l, m, line)) << l;
    const auto config = nlohmann::json::parse(m[5].str());
    const std::string type = config["task"]["type"];
    const int index = config["task"]["index"];
    if (m[1] == "ps") {
      EXPECT_EQ(m[3], "none") << "a shard has no worker rank";
      EXPECT_EQ(type, "ps");
      EXPECT_EQ(std::to_string(index), m[2].str());
    } else {
      EXPECT_EQ(m[3], m[2]);
      EXPECT_EQ(type, m[2] == "0" ? "chief" : "worker");
    }
    EXPECT_EQ(config["cluster"]["ps"].size(), 2u);
    EXPECT_EQ(config["cluster"]["worker"].size(), 1u);
    clusters[type + std::to_string(index)] = config["cluster"];
    tokens.insert(m[4]);
    tasks.insert(type + std::to_string(index));
  }
  EXPECT_EQ(tasks.size(), 4u) << r.output;
  // A shard's own address has port 0: it binds one of its choosing.
  EXPECT_EQ(clusters["ps0"]["ps"][0], "127.0.0.1:0") << r.output;
  EXPECT_EQ(clusters["ps1"]["ps"][1], "127.0.0.1:0") << r.output;
  // The chief knows the shards' ports, its own is 0; the worker knows all, and listens on nothing.
  const nlohmann::json shards = {"127.0.0.1:20000", "127.0.0.1:20001"};
  EXPECT_EQ(clusters["chief0"]["ps"], shards) << r.output;
  EXPECT_EQ(clusters["chief0"]["chief"][0], "127.0.0.1:0") << r.output;
  EXPECT_EQ(clusters["worker0"]["ps"], shards) << r.output;
  EXPECT_EQ(clusters["worker0"]["chief"][0], "127.0.0.1:4242") << r.output;
  EXPECT_EQ(clusters["worker0"]["worker"][0], "127.0.0.1:0") << r.output;
  ASSERT_EQ(tokens.size(), 1u) << r.output;
  EXPECT_EQ(tokens.begin()->size(), 32u);
}

TEST(Launch, StdoutAndStderrArePrefixedApart) {
  LauncherProcess p({test::cohortBinary(), "launch", "-n", "2", "--",
                     "sh", "-c", "echo out-$RANK; echo err-$RANK >&2; printf 'bar 10%%\\rbar 20%%\\n'; printf tail-$RANK"});
  ASSERT_EQ(p.wait(seconds(60)), 0) << p.out() << p.err();
  for (const std::string i : {"0", "1"}) {
    EXPECT_NE(p.out().find("[rank " + i + "] out-" + i + "\n"), std::string::npos) << p.out();
    EXPECT_NE(p.err().find("[rank " + i + "] err-" + i + "\n"), std::string::npos) << p.err();
    // A partial last line is flushed when the pipe closes; '\r' stays inside its line.
    EXPECT_NE(p.out().find("[rank " + i + "] tail-" + i + "\n"), std::string::npos) << p.out();
    EXPECT_NE(p.out().find("[rank " + i + "] bar 10%\rbar 20%\n"), std::string::npos) << p.out();
  }
  EXPECT_EQ(p.out().find("err-"), std::string::npos) << p.out();
  EXPECT_EQ(p.err().find("out-"), std::string::npos) << p.err();
}

TEST(Launch, ManyLinesArriveWholeAndInOrder) {
  constexpr int kLines = 20000;
  LauncherProcess p({test::cohortBinary(), "launch", "-n", "3", "--", "seq", "1", std::to_string(kLines)});
  ASSERT_EQ(p.wait(seconds(60)), 0) << p.err();
  std::vector<int> next(3, 1);
  const std::regex line(R"(\[rank (\d)\] (\d+))");
  for (const auto& l : test::lines(p.out())) {
    std::smatch m;
    ASSERT_TRUE(std::regex_match(l, m, line)) << l;
    const int rank = std::stoi(m[1]);
    ASSERT_EQ(std::stoi(m[2]), next[size_t(rank)]) << "rank " << rank;
    ++next[size_t(rank)];
  }
  EXPECT_EQ(next, std::vector<int>(3, kLines + 1));
}

// A non-blocking standard output (the launcher's write meets EAGAIN whenever the pipe is full)
// loses no line: it dropped the rest of every write that found the pipe full (4,752 of 200,000
// lines arrived).
TEST(Launch, ANonBlockingStdoutLosesNoLine) {
  constexpr int kLines = 50000;
  LauncherProcess p({test::cohortBinary(), "launch", "-n", "1", "--", "seq", "1", std::to_string(kLines)}, true);
  ASSERT_EQ(p.wait(seconds(120)), 0) << p.err();
  int next = 1;
  for (const auto& l : test::lines(p.out())) {
    ASSERT_EQ(l, "[rank 0] " + std::to_string(next)) << "line " << next;
    ++next;
  }
  EXPECT_EQ(next, kLines + 1);
}

// This machine's first non-loopback IPv4 address, or "" when it has none.
std::string nonLoopbackAddress() {
  ifaddrs* all = nullptr;
  if (::getifaddrs(&all) != 0) return "";
  std::string found;
  for (ifaddrs* a = all; a != nullptr && found.empty(); a = a->ifa_next) {
    if (a->ifa_addr == nullptr || a->ifa_addr->sa_family != AF_INET) continue;
    char text[INET_ADDRSTRLEN] = {};
    ::inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(a->ifa_addr)->sin_addr, text, sizeof(text));
    if (std::string(text).rfind("127.", 0) != 0) found = text;
  }
  ::freeifaddrs(all);
  return found;
}

// GLOO_SOCKET_IFNAME as a list (PyTorch's reading): a job on a non-loopback master address trains
// with one Gloo device per name; it failed with Gloo's "Unable to find address for: lo,lo".
TEST(Launch, GlooSocketIfnameMayListSeveralInterfaces) {
  const std::string host = nonLoopbackAddress();
  ASSERT_FALSE(host.empty()) << "this machine has no non-loopback IPv4 address to put the master on";
  auto r = test::runCommand(
      "env GLOO_SOCKET_IFNAME=lo,lo " + launch("--host " + host + " -n 2 -- " + test::cohortBinary() +
                                               " train --strategy allreduce --model mlp --data synthetic:200 --batch 8 "
                                               "--steps 3 --threads 1 --progress off --timeout 30"),
      120);
  EXPECT_EQ(r.exitCode, 0) << r.output;
  EXPECT_NE(r.output.find("done: 3 steps"), std::string::npos) << r.output;
}

TEST(Launch, CommandArgumentsMayStartWithADash) {
  auto r = test::runCommand(launch("-n 1 -- sh -c 'echo \"args $0 $1 $2\"' -n --port --"), 60);
  ASSERT_EQ(r.exitCode, 0) << r.output;
  EXPECT_EQ(r.output, "[rank 0] args -n --port --\n");
  // Without "--" the command starts at the first argument that is not an option of launch.
  r = test::runCommand(launch("-n 1 sh -c 'echo \"args $0\"' -x"), 60);
  ASSERT_EQ(r.exitCode, 0) << r.output;
  EXPECT_EQ(r.output, "[rank 0] args -x\n");
}

TEST(Launch, AFailingRankStopsTheOthersWithItsStatus) {
  const auto start = Clock::now();
  auto r = test::runCommand(
      launch("-n 3" + kWithPort + " -- sh -c 'if [ \"$RANK\" = 1 ]; then echo bye; exit 7; fi; exec sleep 60'"), 30);
  EXPECT_NE(r.exitCode, 124) << "the sleeping ranks were not stopped\n" << r.output;
  EXPECT_EQ(r.exitCode, 7) << r.output;
  EXPECT_LT(Clock::now() - start, seconds(20));
  EXPECT_NE(r.output.find("[rank 1] bye\ncohort launch: rank 1 exited with status 7\n"), std::string::npos)
      << r.output;
  EXPECT_EQ(count(r.output, "cohort launch:"), 1u) << r.output;  // only the first failure is reported
}

// Each rank runs in a process group of its own, which the launcher stops whole: what a wrapper
// started (here the sleep of `sh -c`) ends with the job, also across a restart. (Only the shells
// were signalled before: every sleep outlived the launcher.)
TEST(Launch, WhatARankStartedEndsWithIt) {
  test::TempDir dir;
  auto r =
      // Rank 1 fails once rank 0's sleep is started and written down (a poll of the file: nothing
      // else tells it), so that the launcher's stop never comes before rank 0 has started it.
      test::runCommand(launch("-n 2 --max-restarts 1" + kWithPort + " -- sh -c 'sleep 300 & echo $! > " + dir.path() +
                              "/$RANK-$COHORT_RESTART_COUNT; if [ \"$RANK\" = 1 ]; then while [ ! -s " + dir.path() +
                              "/0-$COHORT_RESTART_COUNT ]; do sleep 0.01; done; exit 3; fi; wait'"),
                       60);
  EXPECT_EQ(r.exitCode, 3) << r.output;
  int seen = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir.path())) {
    const std::string pid = test::lines(test::readFile(entry.path().string())).at(0);
    auto state = [&] {  // X once reaped; Z while dead and not reaped (by whoever adopted it)
      const std::string stat = test::readFile("/proc/" + pid + "/stat");
      const size_t paren = stat.rfind(')');
      return paren == std::string::npos ? 'X' : stat.at(paren + 2);
    };
    // A SIGKILL sent is acted on when the process next runs: re-read it for a while (no event says so).
    const auto until = Clock::now() + seconds(10);
    while (state() != 'X' && state() != 'Z' && Clock::now() < until)
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    EXPECT_TRUE(state() == 'X' || state() == 'Z') << entry.path() << ": sleep " << pid << " is in state " << state();
    ++seen;
  }
  EXPECT_EQ(seen, 4) << r.output;  // two ranks, twice
}

TEST(Launch, ARankKilledBySignalGives128PlusTheSignal) {
  auto r = test::runCommand(launch("-n 2 -- sh -c 'if [ \"$RANK\" = 0 ]; then kill -9 $$; fi; exec sleep 60'"), 30);
  EXPECT_EQ(r.exitCode, 137) << r.output;
  EXPECT_NE(r.output.find("cohort launch: rank 0 was killed by signal 9 (SIGKILL)"), std::string::npos) << r.output;
}

TEST(Launch, RanksIgnoringSigtermAreKilledAfterTheGracePeriod) {
  LauncherProcess p({test::cohortBinary(), "launch", "-n", "2", "--grace", "1", "--port", std::to_string(kAnyPort), "--",
                     "sh", "-c", "trap '' TERM; echo \"ready $RANK $$\"; exec sleep 60"});
  ASSERT_TRUE(p.waitForOutput("] ready ", 2, seconds(30))) << p.out() << p.err();
  std::smatch m;
  ASSERT_TRUE(std::regex_search(p.out(), m, std::regex(R"(\[rank 1\] ready 1 (\d+))"))) << p.out();
  const auto killedAt = Clock::now();
  ASSERT_EQ(::kill(pid_t(std::stoi(m[1])), SIGKILL), 0);
  EXPECT_EQ(p.wait(seconds(30)), 137) << p.err();
  EXPECT_GE(Clock::now() - killedAt, std::chrono::milliseconds(900));  // rank 0 had its grace period
  EXPECT_NE(p.err().find("cohort launch: rank 1 was killed by signal 9 (SIGKILL)\n"), std::string::npos) << p.err();
  EXPECT_NE(p.err().find("cohort launch: rank 0 did not stop within 1 s, killing it\n"), std::string::npos)
      << p.err();
}

// A second job given the --port of a running one is told that another job is on the port (its
// chief cannot bind it, its other ranks find a store that refuses their secret), not only that
// the secrets differ; the first job is untouched.
TEST(Launch, ASecondJobOnARunningJobsPortIsToldAnotherJobIsThere) {
  test::ReservedPort port;
  const std::vector<std::string> train = {test::cohortBinary(), "train", "--strategy", "allreduce", "--model", "mlp",
                                          "--data", "synthetic:2000", "--steps", "1000000", "--progress", "lines",
                                          "--threads", "1"};
  std::vector<std::string> first = {test::cohortBinary(), "launch", "-n", "2", "--port", std::to_string(port.port()),
                                    "--"};
  first.insert(first.end(), train.begin(), train.end());
  LauncherProcess a(first);
  ASSERT_TRUE(a.waitForError("[rank 0] step ", seconds(90))) << a.out() << a.err();  // A's group trains (progress: stderr)

  auto b = test::runCommand(launch("-n 2 --port " + std::to_string(port.port()) + " -- " + test::cohortBinary() +
                                   " train --strategy allreduce --model mlp --data synthetic:2000 --steps 10 "
                                   "--progress off --threads 1 --timeout 10"),
                            90);
  EXPECT_NE(b.exitCode, 0) << b.output;
  // The launcher's own summary (whichever rank failed first) names the cause.
  const size_t summary = b.output.find("cohort launch: rank ");
  ASSERT_NE(summary, std::string::npos) << b.output;
  EXPECT_NE(b.output.find("another job", summary), std::string::npos) << b.output;
  EXPECT_TRUE(a.running()) << a.out() << a.err();  // the first job goes on
}

// Without a secret (ranks started with torchrun's variables only), two jobs on one port refuse each
// other by their launcher's job id, and a process that has none is refused too: job A's chief
// waits for its rank 1 with its store listening; B's rank 1 and an outsider's find it.
TEST(Launch, TokenlessJobsOnOnePortRefuseEachOtherByTheirJobId) {
  test::ReservedPort port;
  const std::string where = "env -u COHORT_AUTH_TOKEN -u COHORT_JOB_ID -u SLURM_JOB_ID -u PMIX_NAMESPACE "
                            "MASTER_ADDR=127.0.0.1 MASTER_PORT=" + std::to_string(port.port()) + " WORLD_SIZE=2 ";
  const std::string train = test::cohortBinary() + " train --strategy allreduce --model mlp --data synthetic:500 "
                                                   "--steps 5 --progress off --threads 1 ";
  LauncherProcess a({"sh", "-c", where + "RANK=0 TORCHELASTIC_RUN_ID=job-a " + train + "--timeout 60"});
  ASSERT_TRUE(a.waitForError("its identity (TORCHELASTIC_RUN_ID) keeps other jobs off", seconds(60)))
      << a.out() << a.err();  // A's chief warns, then listens

  auto b = test::runCommand(where + "RANK=1 TORCHELASTIC_RUN_ID=job-b " + train + "--timeout 10", 60);
  EXPECT_NE(b.exitCode, 0) << b.output;
  EXPECT_NE(b.output.find("another job may be listening on this port"), std::string::npos) << b.output;

  auto outsider = test::runCommand(where + "RANK=1 " + train + "--timeout 10", 60);
  EXPECT_NE(outsider.exitCode, 0) << outsider.output;
  EXPECT_NE(outsider.output.find("needs the job's secret"), std::string::npos) << outsider.output;
  EXPECT_TRUE(a.running()) << a.out() << a.err();  // A still waits for its own rank 1
}

// Gloo's rendezvous value for `rank` (gloo/transport/tcp/context.cc, Rank::bytes): the host name
// and the device address, each after its size_t length, then one pair identifier (ssize_t) per
// rank. An outsider who can write the store forges one that sends the other ranks to `to`.
std::vector<uint8_t> forgedGlooRank(const std::vector<uint8_t>& honest, const sockaddr_in& to) {
  size_t hostBytes = 0;
  std::memcpy(&hostBytes, honest.data(), sizeof(hostBytes));
  const size_t addressAt = sizeof(size_t) + hostBytes + sizeof(size_t);
  std::vector<uint8_t> forged = honest;
  sockaddr_storage storage{};
  std::memcpy(&storage, &to, sizeof(to));
  std::memcpy(forged.data() + addressAt, &storage, sizeof(storage));  // the sequence number after it stays
  return forged;
}

// Without a secret or a job id the store is open (the chief says so): an outsider who writes rank
// 1's Gloo address before rank 1 does makes the chief wait for a connection that never comes (Gloo
// pairs compare their addresses: the lower listens, and port 65535 is above the chief's). The
// chief must give up within its --timeout (and formGlooGroup's margin of 2 s), naming the Gloo
// group and what may be wrong, where it waited five timeouts in Gloo (issue 30: 75 s at --timeout
// 15).
TEST(Launch, AForgedGlooAddressWithoutASecretEndsWithinTheTimeout) {
  test::ReservedPort port;
  const std::string where =
      "env -u COHORT_AUTH_TOKEN -u COHORT_JOB_ID -u SLURM_JOB_ID -u PMIX_NAMESPACE "
      "-u TORCHELASTIC_RUN_ID MASTER_ADDR=127.0.0.1 MASTER_PORT=" +
      std::to_string(port.port()) + " WORLD_SIZE=2 ";
  const int timeout = 5;
  LauncherProcess chief({"sh", "-c",
                         where + "RANK=0 " + test::cohortBinary() +
                             " train --strategy allreduce --model mlp --data synthetic:500 --steps 5 "
                             "--progress off --threads 1 --timeout " +
                             std::to_string(timeout)});
  ASSERT_TRUE(chief.waitForError("this job has no secret", seconds(60))) << chief.err();

  auto outsider = store::Client::connect("127.0.0.1", port.port(), "", std::chrono::seconds(30));
  const auto honest = outsider->get("cohort/group/0/0", std::chrono::seconds(30));
  ASSERT_TRUE(honest.has_value()) << chief.err();
  sockaddr_in to{};
  to.sin_family = AF_INET;
  to.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  to.sin_port = htons(65535);
  const auto forgedAt = Clock::now();
  outsider->set("cohort/group/0/1", forgedGlooRank(*honest, to));

  const int status = chief.wait(seconds(60));
  const auto took = Clock::now() - forgedAt;
  EXPECT_NE(status, 0) << chief.err();
  EXPECT_NE(chief.err().find("forming the Gloo group"), std::string::npos) << chief.err();
  EXPECT_NE(chief.err().find("every rank gave its Gloo address"), std::string::npos) << chief.err();
  // Its own timeout and the 1.5 s in which it looks for lost heartbeats, with room for a loaded
  // machine; before, 5 timeouts.
  EXPECT_LT(took, seconds(3 * timeout)) << chief.err();
}

class LaunchSignal : public testing::TestWithParam<int> {};

TEST_P(LaunchSignal, IsForwardedToEveryRank) {
  const int signo = GetParam();
  const std::string name = signo == SIGINT ? "INT" : "TERM";
  // `wait` returns as soon as a trapped signal arrives; the trap stops the background sleep.
  LauncherProcess p({test::cohortBinary(), "launch", "-n", "3", "--port", std::to_string(kAnyPort), "--",
                     "sh", "-c", "trap 'echo got-" + name + "-$RANK; kill $s; exit 0' " + name +
                                     "; sleep 60 & s=$!; echo ready-$RANK; wait $s"});
  ASSERT_TRUE(p.waitForOutput("] ready-", 3, seconds(30))) << p.out() << p.err();
  ASSERT_EQ(::kill(p.pid(), signo), 0);
  EXPECT_EQ(p.wait(seconds(30)), 128 + signo) << p.out() << p.err();
  for (const std::string i : {"0", "1", "2"}) {
    EXPECT_NE(p.out().find("[rank " + i + "] got-" + name + "-" + i + "\n"), std::string::npos) << p.out();
  }
  EXPECT_NE(p.err().find("cohort launch: got SIG" + name), std::string::npos) << p.err();
}

INSTANTIATE_TEST_SUITE_P(LaunchSignals, LaunchSignal, testing::Values(SIGTERM, SIGINT));

TEST(Launch, AMissingCommandExits127NamingIt) {
  auto r = test::runCommand(launch("-n 2 -- cohort-no-such-command --flag"), 30);
  EXPECT_EQ(r.exitCode, 127) << r.output;
  EXPECT_NE(r.output.find("cannot run cohort-no-such-command: No such file or directory"), std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("exited with status 127"), std::string::npos) << r.output;
}

void expectUsageError(const std::string& args, const std::string& needle) {
  auto r = test::runCommand(launch(args), 30);
  EXPECT_EQ(r.exitCode, 2) << args << "\n" << r.output;
  const auto lines = test::lines(r.output);
  ASSERT_EQ(lines.size(), 1u) << args << "\n" << r.output;
  EXPECT_EQ(lines[0].rfind("cohort: error: ", 0), 0u) << lines[0];
  EXPECT_NE(lines[0].find(needle), std::string::npos) << "expected '" << needle << "' in: " << lines[0];
}

TEST(Launch, BadArgumentsExit2) {
  expectUsageError("-n 0 -- true", "-n/--nproc must be at least 1 (got 0)");
  expectUsageError("-n -3 -- true", "-n/--nproc must be at least 1 (got -3)");
  expectUsageError("-n two -- true", "-n");
  expectUsageError("-- true", "--nproc is required");
  expectUsageError("-n 2", "no command to launch");
  expectUsageError("-n 2 --", "no command to launch");
  expectUsageError("-n 2 --port 70000 -- true", "--port must be between 0 and 65535");
  expectUsageError("-n 2 --port -1 -- true", "--port must be between 0 and 65535");
  expectUsageError("-n 2 --grace -1 -- true", "--grace must be");
  expectUsageError("-n 2 --host no-such-host.invalid -- true", "--host no-such-host.invalid");
}

}  // namespace
}  // namespace cohort::launch_test
