// `cohort compare --hosts` through a real ssh: a private sshd (Debian's openssh-server) on
// 127.0.0.1 at a free port, run as the current user with host and user keys made for the test, and
// the hosts "127.0.0.1" and "localhost" (two names for this machine, so the placement, the per-process
// ports and the addresses are exercised as on two hosts). The runs ok and in the report; a run
// stopped by --run-timeout and a comparison stopped by SIGINT leave no process on the "hosts"; an
// unreachable host is a one-line error before any run. A test that cannot start sshd fails.
#include "process_list.h"
#include "test_util.h"

#include <sys/syscall.h>

#include <algorithm>
#include <filesystem>
#include <random>

namespace cohort {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

constexpr const char* kSshd = "/usr/sbin/sshd";

// `count` consecutive ports on 127.0.0.1 held for as long as this object lives, as
// test::ReservedPort holds one (SO_REUSEADDR, never listening): the base port of a comparison's
// processes, each of which listens (if at all) with SO_REUSEADDR on base + i.
class ReservedPorts {
 public:
  explicit ReservedPorts(int count) {
    std::mt19937 rng(std::random_device{}());
    for (int attempt = 0; attempt < 100 && fds_.empty(); ++attempt) {
      const int base = 20000 + int(rng() % 20000);
      for (int i = 0; i < count; ++i) {
        const int fd = bindLoopback(base + i);
        if (fd < 0) {
          release();
          break;
        }
        fds_.push_back(fd);
      }
      if (!fds_.empty()) base_ = base;
    }
    if (fds_.empty()) throw std::runtime_error("ReservedPorts: no free range of " + std::to_string(count) + " ports");
  }
  ~ReservedPorts() { release(); }
  ReservedPorts(const ReservedPorts&) = delete;
  ReservedPorts& operator=(const ReservedPorts&) = delete;
  int base() const { return base_; }

 private:
  static int bindLoopback(int port) {
    const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    const int one = 1;
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = htons(uint16_t(port));
    if (fd < 0 || ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one)) != 0 ||
        ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
      if (fd >= 0) ::close(fd);
      return -1;
    }
    return fd;
  }
  void release() {
    for (int fd : fds_) ::close(fd);
    fds_.clear();
  }
  std::vector<int> fds_;
  int base_ = 0;
};

// A private sshd on 127.0.0.1: keys, config and log in `dir`, logins as the current user with the
// test's key only. Throws with what went wrong when it cannot start (the tests then fail).
class PrivateSshd {
 public:
  explicit PrivateSshd(const test::TempDir& dir) : dir_(dir.file("ssh")) {
    if (!fs::exists(kSshd)) {
      throw std::runtime_error(std::string(kSshd) + " is missing: install Debian's openssh-server (scripts/setup.sh does)");
    }
    fs::create_directories(dir_);
    for (const char* key : {"host_key", "user_key"}) {
      auto r = test::runCommand("ssh-keygen -q -t ed25519 -N '' -f " + dir_ + "/" + key, 30);
      if (r.exitCode != 0) throw std::runtime_error("ssh-keygen failed: " + r.output);
    }
    fs::copy_file(dir_ + "/user_key.pub", dir_ + "/authorized_keys");
    // Root's sshd wants its privilege-separation folder (made at boot by the service, not here).
    if (::geteuid() == 0) fs::create_directories("/run/sshd");
    test::writeFile(dir_ + "/sshd_config",
                    "Port " + std::to_string(port_.port()) + "\nListenAddress 127.0.0.1\nHostKey " + dir_ +
                        "/host_key\nAuthorizedKeysFile " + dir_ + "/authorized_keys\nPidFile " + dir_ +
                        "/sshd.pid\nStrictModes no\nUsePAM no\nPasswordAuthentication no\n"
                        "KbdInteractiveAuthentication no\nPermitRootLogin prohibit-password\nLogLevel INFO\n");
    log_ = dir_ + "/sshd.log";
    test::writeFile(log_, "");
    pid_ = ::fork();
    if (pid_ == 0) {
      ::setpgid(0, 0);
      ::execl(kSshd, kSshd, "-D", "-f", (dir_ + "/sshd_config").c_str(), "-E", log_.c_str(), nullptr);
      ::_exit(127);
    }
    if (!test::waitForFileText(log_, "Server listening on 127.0.0.1", std::chrono::seconds(30))) {
      stop();
      throw std::runtime_error("sshd did not start within 30 s: " + test::readFile(log_));
    }
  }
  ~PrivateSshd() { stop(); }
  PrivateSshd(const PrivateSshd&) = delete;
  PrivateSshd& operator=(const PrivateSshd&) = delete;

  // compare's --remote-shell: this sshd, this key, no known_hosts and no user configuration.
  std::string remoteShell() const {
    return "ssh -F /dev/null -p " + std::to_string(port_.port()) + " -i " + dir_ +
           "/user_key -o IdentitiesOnly=yes -o BatchMode=yes -o StrictHostKeyChecking=no "
           "-o UserKnownHostsFile=/dev/null -o LogLevel=ERROR {host}";
  }
  std::string log() const { return test::readFile(log_); }

 private:
  void stop() {
    if (pid_ <= 0) return;
    ::kill(-pid_, SIGTERM);  // sshd and the sessions it still serves
    ::waitpid(pid_, nullptr, 0);
    pid_ = -1;
  }
  std::string dir_;
  test::ReservedPort port_;
  std::string log_;
  pid_t pid_ = -1;
};

size_t count(const std::string& text, const std::string& needle) {
  size_t n = 0;
  for (size_t at = text.find(needle); at != std::string::npos; at = text.find(needle, at + 1)) ++n;
  return n;
}


std::string compareArgs(const PrivateSshd& sshd, const ReservedPorts& ports, const std::string& out) {
  return " --hosts 127.0.0.1,localhost --base-port " + std::to_string(ports.base()) + " --remote-shell '" +
         sshd.remoteShell() + "' --no-png --out " + out;
}

// Two configurations, allreduce and ps async, each rank slowed to 0.5 s a step: long enough for a
// run to be stopped half-way.
constexpr const char* kSlowFile = R"(model = "mlp"
data = "synthetic:600"
batch = 16
threads = 1
test_slow_worker = "0:0.5,1:0.5"

[[configuration]]
name = "allreduce"
strategy = "allreduce"
workers = 2

[[configuration]]
name = "ps-async"
strategy = "ps"
workers = 2
ps = 1
ps_mode = "async"
)";

TEST(CompareHosts, EveryProcessRunsOnAHostThroughSsh) {
  test::TempDir dir;
  PrivateSshd sshd(dir);
  ReservedPorts ports(3);
  const std::string out = dir.file("out");
  auto r = test::runCommand(test::cohortBinary() +
                                " compare --only allreduce,ps-async --model mlp --data synthetic:600 --batch 16"
                                " --steps 6 --evaluations 1" + compareArgs(sshd, ports, out),
                            300);
  ASSERT_EQ(r.exitCode, 0) << r.output;
  EXPECT_NE(r.output.find("allreduce.r1: ok"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("ps-async.r1: ok"), std::string::npos) << r.output;
  // Both runs in the data and the report, with where they ran.
  const std::string summary = test::readFile(out + "/summary.csv");
  EXPECT_NE(summary.find("\nallreduce,1,"), std::string::npos) << summary;
  EXPECT_NE(summary.find("\nps-async,1,"), std::string::npos) << summary;
  EXPECT_NE(test::readFile(out + "/report.html").find("hosts 127.0.0.1, localhost"), std::string::npos);
  for (const char* run : {"allreduce.r1", "ps-async.r1"}) {
    EXPECT_FALSE(test::lastEvent(out + "/runs/" + run + "/metrics.jsonl", "done").is_null()) << run;
  }
  // Placement: rank 0 on the first host, rank 1 on the second, the shard (process 2) on the first,
  // each at base + i; the variables on the remote command line, the token not.
  const std::string allreduce = test::readFile(out + "/runs/allreduce.r1/status.json");
  const std::string base = std::to_string(ports.base());
  EXPECT_NE(allreduce.find("MASTER_ADDR=127.0.0.1 MASTER_PORT=" + base + " RANK=1 WORLD_SIZE=2"), std::string::npos)
      << allreduce;
  EXPECT_EQ(count(allreduce, "{host}"), 0u);
  EXPECT_EQ(count(allreduce, "LogLevel=ERROR 127.0.0.1 "), 1u) << allreduce;
  EXPECT_EQ(count(allreduce, "LogLevel=ERROR localhost "), 1u) << allreduce;
  EXPECT_EQ(allreduce.find("COHORT_AUTH_TOKEN="), std::string::npos);  // read from stdin there
  const std::string ps = test::readFile(out + "/runs/ps-async.r1/status.json");
  const std::string cluster = "\\\"chief\\\":[\\\"127.0.0.1:" + base + "\\\"],\\\"worker\\\":[\\\"localhost:" +
                              std::to_string(ports.base() + 1) + "\\\"],\\\"ps\\\":[\\\"127.0.0.1:" +
                              std::to_string(ports.base() + 2) + "\\\"]";
  EXPECT_EQ(count(ps, cluster), 3u) << ps;
  // Every process came in through sshd: 2 + 3, and one check per distinct host.
  EXPECT_EQ(count(sshd.log(), "Accepted publickey"), 7u) << sshd.log();
  EXPECT_TRUE(test::processesMentioning(out + "/runs/").empty());
}

TEST(CompareHosts, ARunStoppedByTheRunTimeoutLeavesNoProcessOnTheHosts) {
  test::TempDir dir;
  PrivateSshd sshd(dir);
  ReservedPorts ports(3);
  test::writeFile(dir.file("slow.toml"), kSlowFile);
  const std::string out = dir.file("out");
  auto r = test::runCommand(test::cohortBinary() + " compare " + dir.file("slow.toml") +
                                " --steps 400 --evaluations 1 --run-timeout 10" + compareArgs(sshd, ports, out),
                            300);
  EXPECT_NE(r.exitCode, 0) << r.output;  // every run failed
  EXPECT_NE(r.output.find("allreduce.r1: FAILED: timed out after 10 s"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("ps-async.r1: FAILED: timed out after 10 s"), std::string::npos) << r.output;
  // They were training on the hosts when stopped, and the shard was told to stop.
  EXPECT_FALSE(test::lastEvent(out + "/runs/allreduce.r1/metrics.jsonl", "step").is_null());
  EXPECT_NE(test::readFile(out + "/runs/ps-async.r1/output.log").find("cohort ps: SIGTERM"), std::string::npos)
      << test::readFile(out + "/runs/ps-async.r1/output.log");
  // compare returns once the remote shells have, and they return once their processes have.
  EXPECT_TRUE(test::processesMentioning(out + "/runs/").empty()) << "a remote process outlived its run";
}

TEST(CompareHosts, SigintStopsTheRemoteProcesses) {
  test::TempDir dir;
  PrivateSshd sshd(dir);
  ReservedPorts ports(3);
  test::writeFile(dir.file("slow.toml"), kSlowFile);
  const std::string out = dir.file("out");
  const std::string command = test::cohortBinary() + " compare " + dir.file("slow.toml") + " --steps 400" +
                              compareArgs(sshd, ports, out) + " > " + dir.file("log") + " 2>&1";
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    ::setpgid(0, 0);
    ::execl("/bin/sh", "sh", "-c", ("exec " + command).c_str(), nullptr);
    ::_exit(127);
  }
  const int pidfd = int(::syscall(SYS_pidfd_open, pid, 0));
  ASSERT_GE(pidfd, 0);
  // Training on the hosts: rank 0 wrote a step.
  const std::string metrics = out + "/runs/allreduce.r1/metrics.jsonl";
  const bool training = test::waitForPath(metrics, std::chrono::seconds(120)) &&
                        test::waitForFileText(metrics, "\"event\":\"step\"", std::chrono::seconds(60));
  const size_t running = test::processesMentioning(out + "/runs/").size();
  ::kill(pid, SIGINT);  // what Ctrl-C sends compare (its jobs are in process groups of their own)
  pollfd p{pidfd, POLLIN, 0};
  const bool ended = ::poll(&p, 1, 60000) == 1;
  if (!ended) ::kill(-pid, SIGKILL);
  int status = 0;
  ::waitpid(pid, &status, 0);
  ::close(pidfd);
  ASSERT_TRUE(training) << test::readFile(dir.file("log"));
  EXPECT_GE(running, 8u);  // per rank: its ssh, the remote wrapper and its watcher, cohort train
  ASSERT_TRUE(ended) << "compare did not end within 60 s of SIGINT";
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) != 0);
  EXPECT_NE(test::readFile(dir.file("log")).find("interrupted by SIGINT"), std::string::npos)
      << test::readFile(dir.file("log"));
  EXPECT_TRUE(test::processesMentioning(out + "/runs/").empty()) << "a remote process outlived compare";
}

TEST(CompareHosts, AnUnreachableHostIsAOneLineErrorBeforeAnyRun) {
  test::TempDir dir;
  PrivateSshd sshd(dir);
  ReservedPorts ports(3);
  const std::string out = dir.file("out");
  // 127.0.0.2 is this machine too, but sshd listens on 127.0.0.1 only: refused.
  auto r = test::runCommand(test::cohortBinary() +
                                " compare --only allreduce --model mlp --data synthetic:600 --steps 6"
                                " --hosts 127.0.0.1,127.0.0.2 --remote-shell '" + sshd.remoteShell() + "' --out " + out,
                            120);
  EXPECT_EQ(r.exitCode, 2) << r.output;
  const auto lines = test::lines(r.output);
  ASSERT_EQ(lines.size(), 1u) << r.output;
  EXPECT_EQ(lines[0].rfind("cohort: error: --hosts: host 127.0.0.2 does not answer through the remote shell", 0), 0u)
      << lines[0];
  EXPECT_NE(lines[0].find("Connection refused"), std::string::npos) << lines[0];
  EXPECT_FALSE(fs::exists(out)) << "something ran";
  EXPECT_EQ(count(sshd.log(), "Accepted publickey"), 1u) << sshd.log();  // the check of 127.0.0.1 only
}

// --device with --hosts: every host trains one step on that device before anything runs; a host
// that cannot (this one has no GPU) is a one-line error naming it, the device and why.
TEST(CompareHosts, AHostThatCannotTrainOnTheDeviceIsAOneLineErrorBeforeAnyRun) {
  test::TempDir dir;
  PrivateSshd sshd(dir);
  ReservedPorts ports(3);
  const std::string out = dir.file("out");
  auto r = test::runCommand(test::cohortBinary() +
                                " compare --only allreduce --model mlp --data synthetic:600 --steps 6 --device cuda:3" +
                                compareArgs(sshd, ports, out),
                            120);
  EXPECT_EQ(r.exitCode, 2) << r.output;
  const auto lines = test::lines(r.output);
  ASSERT_EQ(lines.size(), 1u) << r.output;
  EXPECT_EQ(lines[0].rfind("cohort: error: --hosts: host 127.0.0.1 cannot train --model mlp on --device cuda:3: ", 0),
            0u)
      << lines[0];
  EXPECT_NE(lines[0].find("cuda:3"), lines[0].rfind("cuda:3")) << "the host's own reason is missing: " << lines[0];
  EXPECT_FALSE(fs::exists(out)) << "something ran";
}

}  // namespace
}  // namespace cohort
