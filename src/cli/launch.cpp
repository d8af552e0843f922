#include "cli/launch.h"

#include "base/crypto.h"
#include "cli/launch_policy.h"

#include <cohort/error.h>

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <string_view>
#include <random>
#include <thread>
#include <vector>

extern char** environ;

namespace cohort::cli {
namespace {

using Clock = std::chrono::steady_clock;

constexpr int kMaxPort = 65535;
// More processes than any one machine trains with; RLIMIT_NPROC may lower it.
constexpr long kMaxProcesses = 1024;
// Where a child finds its launcher channel (COHORT_LAUNCH_FD).
constexpr int kChannelFd = 3;
constexpr size_t kMaxLine = 64 * 1024;  // a longer line is forwarded in pieces
constexpr size_t kReadChunk = 64 * 1024;
constexpr int kReadsPerWakeup = 16;     // so that one busy writer cannot starve the others
constexpr std::array<int, 3> kHandledSignals{SIGINT, SIGTERM, SIGCHLD};
// Restarts of an evaluator killed by a signal, per job (they do not use up --max-restarts).
constexpr int kEvaluatorRestarts = 3;
// How long the launcher waits for a listening process (the chief, a shard) to tell its port.
constexpr std::chrono::seconds kPortReportTimeout{120};
// When the launcher says, once, whom it is waiting for (a program that does not tell its port would
// otherwise leave the user looking at a silent terminal until kPortReportTimeout).
constexpr std::chrono::seconds kPortNoticeAfter{5};

// The write end of the self-pipe. The handlers only write the signal number there; the main loop
// polls the read end and does the work.
int signalPipeWrite = -1;

void onSignal(int signo) {
  const int savedErrno = errno;
  const auto byte = static_cast<unsigned char>(signo);
  [[maybe_unused]] const ssize_t n = ::write(signalPipeWrite, &byte, 1);
  errno = savedErrno;
}

std::string errorText(int error) { return std::strerror(error); }

std::string signalName(int signo) {
  const char* abbrev = ::sigabbrev_np(signo);
  return abbrev != nullptr ? std::string("SIG") + abbrev : "unknown signal";
}

// Writes all of data, retrying after signals. Errors are dropped: there is nowhere to report them.
void writeAll(int fd, std::string_view data) {
  while (!data.empty()) {
    const ssize_t n = ::write(fd, data.data(), data.size());
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;
    data.remove_prefix(size_t(n));
  }
}

void say(const std::string& line) { writeAll(STDERR_FILENO, "cohort launch: " + line + "\n"); }

// The lines coming out of one pipe of one child, written with a prefix to one launcher stream.
class LineForwarder {
 public:
  LineForwarder(int fd, int target, std::string prefix) : fd_(fd), target_(target), prefix_(std::move(prefix)) {}
  LineForwarder(const LineForwarder&) = delete;
  LineForwarder& operator=(const LineForwarder&) = delete;
  ~LineForwarder() { close(); }

  int fd() const { return fd_; }
  bool isOpen() const { return fd_ >= 0; }

  // Reads what the pipe holds now (a bounded amount) and forwards every complete line. At end of
  // file, forwards the partial last line and closes the pipe. Returns true if more may be waiting.
  bool readAvailable() {
    std::array<char, kReadChunk> buffer;
    for (int i = 0; i < kReadsPerWakeup && isOpen(); ++i) {
      const ssize_t n = ::read(fd_, buffer.data(), buffer.size());
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return false;
      if (n <= 0) {
        close();
        return false;
      }
      pending_.append(buffer.data(), size_t(n));
      forwardLines();
    }
    return isOpen();
  }

  // Forwards what is left, the partial last line included, and closes the pipe.
  void close() {
    if (!isOpen()) return;
    ::close(fd_);
    fd_ = -1;
    if (!pending_.empty()) emit(pending_);
    pending_.clear();
  }

 private:
  void forwardLines() {
    size_t begin = 0;
    for (;;) {
      const size_t newline = pending_.find('\n', begin);
      if (newline == std::string::npos) {
        if (pending_.size() - begin < kMaxLine) break;
        emit(std::string_view(pending_).substr(begin, kMaxLine));
        begin += kMaxLine;
        continue;
      }
      emit(std::string_view(pending_).substr(begin, newline - begin));
      begin = newline + 1;
    }
    pending_.erase(0, begin);
  }

  void emit(std::string_view line) {
    std::string out;
    out.reserve(prefix_.size() + line.size() + 1);
    out.append(prefix_).append(line).push_back('\n');
    writeAll(target_, out);  // one write per line keeps lines whole when streams are shared
  }

  int fd_;
  const int target_;
  const std::string prefix_;
  std::string pending_;
};

// The read end of a child's launcher channel (base/launcher_channel.h): whole lines, handed over
// one by one; a partial last line is dropped at end of file.
class ChannelReader {
 public:
  explicit ChannelReader(int fd) : fd_(fd) {}
  ChannelReader(const ChannelReader&) = delete;
  ChannelReader& operator=(const ChannelReader&) = delete;
  ~ChannelReader() { close(); }

  int fd() const { return fd_; }
  bool isOpen() const { return fd_ >= 0; }
  void close() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

  // Reads what the pipe holds now and returns the complete lines.
  std::vector<std::string> readLines() {
    std::vector<std::string> lines;
    std::array<char, 4096> buffer;
    for (int i = 0; i < kReadsPerWakeup && isOpen(); ++i) {
      const ssize_t n = ::read(fd_, buffer.data(), buffer.size());
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
      if (n <= 0) {
        close();
        break;
      }
      pending_.append(buffer.data(), size_t(n));
      if (pending_.size() > kMaxLine) pending_.erase(0, pending_.size() - kMaxLine);  // a runaway writer
    }
    for (size_t newline = pending_.find('\n'); newline != std::string::npos; newline = pending_.find('\n')) {
      lines.push_back(pending_.substr(0, newline));
      pending_.erase(0, newline + 1);
    }
    return lines;
  }

 private:
  int fd_;
  std::string pending_;
};

struct Child {
  int rank = 0;
  bool server = false;     // a parameter-server shard (--ps), not a worker
  bool evaluator = false;  // the evaluator task (--evaluator)
  std::string label;       // "rank i", "ps i" or "evaluator"
  pid_t pid = -1;
  bool running = false;
  std::unique_ptr<LineForwarder> out;
  std::unique_ptr<LineForwarder> err;
  std::unique_ptr<ChannelReader> channel;
  bool writesCheckpoints = false;  // a shard that said "shard-checkpoints"
  bool hasCheckpoint = false;      // a shard that said "shard-has-checkpoint" since it was started
  std::string error;               // what it said before failing ("error ...")
  bool finished = false;           // it said "finished": its run is recorded (launch_policy.h)
  bool pending = false;            // not started yet: it needs a port the launcher does not know yet
  int port = -1;                   // what it said ("port P"; 0: "port none" or exited without); -1: nothing
  bool restartedAlone = false;     // started again alone by the failure policy (COHORT_RESTARTED_ALONE=1)
};

// A pipe whose ends are closed on exec; the read end does not block.
std::array<int, 2> openPipe(const std::string& what) {
  std::array<int, 2> fds{-1, -1};
  if (::pipe2(fds.data(), O_CLOEXEC) != 0) throw Error("launch: cannot create a pipe for " + what + ": " + errorText(errno));
  ::fcntl(fds[0], F_SETFL, ::fcntl(fds[0], F_GETFL) | O_NONBLOCK);
  return fds;
}

bool isRemovedFromChildEnv(std::string_view entry) {
  const std::string_view name = entry.substr(0, entry.find('='));
  static constexpr std::array<std::string_view, 8> kAssignedElsewhere{
      "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID", "TF_CONFIG"};
  return std::find(kAssignedElsewhere.begin(), kAssignedElsewhere.end(), name) != kAssignedElsewhere.end() ||
         name.rfind("OMPI_COMM_WORLD_", 0) == 0;
}

bool hasEnv(const char* name) { return std::getenv(name) != nullptr; }

// The environment every child shares: the launcher's, without the rank assignments of other
// launchers, with a thread budget.
std::vector<std::string> sharedChildEnv(int processes) {
  std::vector<std::string> env;
  for (char** entry = environ; *entry != nullptr; ++entry) {
    if (!isRemovedFromChildEnv(*entry)) env.emplace_back(*entry);
  }
  if (!hasEnv("OMP_NUM_THREADS")) {
    const int cores = std::max(1, int(std::thread::hardware_concurrency()));
    const std::string threads = std::to_string(std::max(1, cores / processes));
    env.push_back("OMP_NUM_THREADS=" + threads);
    if (!hasEnv("OPENBLAS_NUM_THREADS")) env.push_back("OPENBLAS_NUM_THREADS=" + threads);
  }
  return env;
}

class Launcher {
 public:
  explicit Launcher(const LaunchOptions& options) : options_(options) {}
  Launcher(const Launcher&) = delete;
  Launcher& operator=(const Launcher&) = delete;

  // On the way out (normally or by an exception) no child is left running or unreaped.
  ~Launcher() {
    for (Child& child : children_) {
      if (!child.running) continue;
      ::kill(child.pid, SIGKILL);
      while (::waitpid(child.pid, nullptr, 0) < 0 && errno == EINTR) {
      }
    }
    children_.clear();
    restoreSignalHandlers();
  }

  int run() {
    installSignalHandlers();
    shared_ = sharedChildEnv(options_.processes);
    // Every job gets a secret: ps shards and gossip peers refuse calls without it.
    if (!hasEnv("COHORT_AUTH_TOKEN")) shared_.push_back("COHORT_AUTH_TOKEN=" + crypto::randomToken());
    for (;;) {
      // A fresh group: every port is told anew (the chief's store and the shards bind port 0 again).
      children_.clear();
      children_.resize(size_t(childCount()));
      for (int i = 0; i < int(children_.size()); ++i) children_[size_t(i)].pending = true;
      portsDeadline_ = Clock::now() + kPortReportTimeout;
      portsNoticeAt_ = Clock::now() + kPortNoticeAfter;
      portsNoticed_ = false;
      startReady();
      superviseUntilAllExited();
      if (!restartGroup_) break;
      restartGroup_ = ending_ = killed_ = workersDone_ = serversStopped_ = false;
      exitCode_ = 0;
      lost_.clear();
    }
    if (exitCode_ == 0 && !lost_.empty()) {
      std::string who;
      for (const std::string& label : lost_) who += (who.empty() ? "" : ", ") + label;
      say("the job finished without " + who);
    }
    return exitCode_;
  }

 private:
  static std::string formatSeconds(double seconds) {
    char text[32];
    std::snprintf(text, sizeof(text), "%g", seconds);
    return text;
  }

  // The ports are chosen by the processes that listen: each binds port 0 and tells the launcher
  // which port it got ("port P" on its channel), and the processes that connect to it are started
  // only then. So the shards start first; the chief once every shard has told its port (it is a
  // client of theirs); the other workers and the evaluator once the chief has told its store's
  // port (or that it has none, "port none"). With --port P the chief is given P instead and
  // nothing waits for it.
  bool portKnown(int index) const { return children_[size_t(index)].port >= 0; }
  int shardIndex(int k) const { return options_.processes + k; }
  bool shardsReady() const {
    for (int k = 0; k < options_.parameterServers; ++k) {
      if (!portKnown(shardIndex(k))) return false;
    }
    return true;
  }
  bool chiefReady() const { return options_.port != 0 || portKnown(0); }
  // MASTER_PORT: --port, else what the chief told (0 until then, and when it listens on nothing).
  int masterPort() const { return options_.port != 0 ? options_.port : std::max(0, children_[0].port); }
  bool anyPending() const {
    return std::any_of(children_.begin(), children_.end(), [](const Child& c) { return c.pending; });
  }

  // Starts every pending process whose addresses are now known.
  void startReady() {
    if (ending_) return;
    for (int i = 0; i < int(children_.size()); ++i) {
      if (!children_[size_t(i)].pending) continue;
      const bool shard = !isEvaluatorIndex(i) && i >= options_.processes;
      const bool ready = shard ? true : i == 0 ? shardsReady() : shardsReady() && chiefReady();
      if (!ready) continue;
      children_[size_t(i)].pending = false;
      start(i);
    }
  }

  // Who has not told its port yet, for the error when it never does.
  std::string silentListeners() const {
    std::string who;
    for (int i = 0; i < int(children_.size()); ++i) {
      const Child& child = children_[size_t(i)];
      const bool listens = child.server || (i == 0 && !child.evaluator && options_.port == 0);
      if (listens && !child.pending && !portKnown(i)) who += (who.empty() ? "" : ", ") + child.label;
    }
    return who;
  }

  void superviseUntilAllExited() {
    while (running_ > 0 || (anyPending() && !ending_)) {
      waitForEvents();
      handleSignals();
      reapChildren();
      startReady();
      if (!ending_ && anyPending() && !portsNoticed_ && Clock::now() >= portsNoticeAt_) {
        portsNoticed_ = true;
        say("waiting for " + silentListeners() + " to tell the port it listens on before starting the others (" +
            std::to_string(kPortReportTimeout.count()) + " s at most); a program that does not write \"port P\" "
            "on COHORT_LAUNCH_FD needs --port P");
      }
      if (!ending_ && anyPending() && Clock::now() >= portsDeadline_) {
        say(silentListeners() + " did not tell the port it listens on within " +
            std::to_string(kPortReportTimeout.count()) +
            " s (a line \"port P\" on COHORT_LAUNCH_FD, which cohort train writes): a program that does not "
            "needs --port P" + (options_.parameterServers > 0 ? ", and cannot run with --ps" : ""));
        exitCode_ = 1;
        endJob(SIGTERM);
      }
      stopServersAfterWorkers();
      if (ending_ && !killed_ && Clock::now() >= deadline_) {
        for (const Child& child : children_) {
          if (child.running) {
            say(child.label + " did not stop within " + formatSeconds(options_.graceSeconds) +
                " s, killing it");
          }
        }
        killRemaining();
      }
    }
    // Every child has exited: forward what they wrote last and stop listening, even if a
    // grandchild still holds a pipe open.
    for (Child& child : children_) closePipes(child);
  }

  void installSignalHandlers() {
    const std::array<int, 2> fds = openPipe("signals");
    signalPipeRead_ = fds[0];
    signalPipeWrite = fds[1];
    ::fcntl(signalPipeWrite, F_SETFL, ::fcntl(signalPipeWrite, F_GETFL) | O_NONBLOCK);
    struct sigaction action {};
    action.sa_handler = onSignal;
    sigemptyset(&action.sa_mask);
    action.sa_flags = SA_NOCLDSTOP;
    for (size_t i = 0; i < kHandledSignals.size(); ++i) {
      ::sigaction(kHandledSignals[i], nullptr, &originalActions_[i]);
      // A launcher started with SIGINT ignored (a background job of a script) keeps ignoring it.
      if (kHandledSignals[i] != SIGCHLD && originalActions_[i].sa_handler == SIG_IGN) continue;
      ::sigaction(kHandledSignals[i], &action, nullptr);
    }
    handlersInstalled_ = true;
  }

  void restoreSignalHandlers() {
    if (handlersInstalled_) {
      for (size_t i = 0; i < kHandledSignals.size(); ++i) ::sigaction(kHandledSignals[i], &originalActions_[i], nullptr);
      handlersInstalled_ = false;
    }
    if (signalPipeRead_ >= 0) ::close(signalPipeRead_);
    if (signalPipeWrite >= 0) ::close(signalPipeWrite);
    signalPipeRead_ = signalPipeWrite = -1;
  }

  bool usesTfConfig() const { return options_.parameterServers > 0 || options_.evaluator; }
  int childCount() const { return options_.processes + options_.parameterServers + (options_.evaluator ? 1 : 0); }
  bool isEvaluatorIndex(int index) const { return options_.evaluator && index == childCount() - 1; }

  // The job's TF_CONFIG (--ps M, --evaluator): rank 0 is the chief at the rendezvous port, the
  // shards at the ports they told; a port not known yet is 0 (a shard's own, the chief's own
  // without --port: it binds any free port and tells it). The other workers and the evaluator
  // listen on nothing: their port is 0. An IPv6 host is bracketed ("[::1]:port").
  std::string tfConfig(int index) const {
    const std::string host = options_.host.find(':') != std::string::npos ? "[" + options_.host + "]" : options_.host;
    auto address = [&](int port) { return "\"" + host + ":" + std::to_string(port) + "\""; };
    std::string workers, servers;
    for (int r = 1; r < options_.processes; ++r) workers += (workers.empty() ? "" : ",") + address(0);
    for (int k = 0; k < options_.parameterServers; ++k) {
      servers += (servers.empty() ? "" : ",") + address(std::max(0, children_[size_t(shardIndex(k))].port));
    }
    const bool evaluator = isEvaluatorIndex(index);
    const bool server = !evaluator && index >= options_.processes;
    const std::string type = evaluator ? "evaluator" : server ? "ps" : index == 0 ? "chief" : "worker";
    const int taskIndex = evaluator ? 0 : server ? index - options_.processes : index == 0 ? 0 : index - 1;
    const std::string evaluators = options_.evaluator ? ",\"evaluator\":[" + address(0) + "]" : "";
    return "{\"cluster\":{\"chief\":[" + address(masterPort()) + "],\"worker\":[" + workers + "],\"ps\":[" + servers +
           "]" + evaluators + "},\"task\":{\"type\":\"" + type + "\",\"index\":" + std::to_string(taskIndex) + "}}";
  }

  // Shards end on their own once every worker said it is done; one that has not within the grace
  // period after the last worker exited is stopped.
  void stopServersAfterWorkers() {
    if (options_.parameterServers == 0 || ending_) return;
    for (const Child& child : children_) {
      if (!child.server && !child.evaluator && (child.running || child.pending)) return;
    }
    if (!workersDone_) {
      workersDone_ = true;
      serversDeadline_ = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                            std::chrono::duration<double>(std::max(options_.graceSeconds, 1.0)));
      return;
    }
    if (Clock::now() < serversDeadline_ || serversStopped_) return;
    serversStopped_ = true;
    for (const Child& child : children_) {
      if (child.running && child.server) ::kill(child.pid, SIGTERM);
    }
  }

  // Starts (or starts again) process `index` with its environment and fresh pipes.
  void start(int index) {
    Child& child = children_[size_t(index)];
    closePipes(child);
    child.rank = index;
    child.evaluator = isEvaluatorIndex(index);
    child.server = !child.evaluator && index >= options_.processes;
    child.label = child.evaluator ? "evaluator"
                  : child.server  ? "ps " + std::to_string(index - options_.processes)
                                  : "rank " + std::to_string(index);
    child.writesCheckpoints = false;
    child.hasCheckpoint = false;
    child.error.clear();
    child.finished = false;
    const std::string name = child.label;
    const int rank = index;
    // Pipes: stdout, stderr, the launcher channel. Every end is closed on exec but the child's
    // copies of the write ends, which it puts in place itself.
    std::vector<int> opened;
    auto open = [&]() {
      try {
        const std::array<int, 2> fds = openPipe(name);
        opened.insert(opened.end(), fds.begin(), fds.end());
        return fds;
      } catch (...) {
        for (size_t i = 1; i < opened.size(); i += 2) ::close(opened[i]);  // the read ends have owners
        throw;
      }
    };
    const std::array<int, 2> out = open();
    child.out = std::make_unique<LineForwarder>(out[0], STDOUT_FILENO, "[" + name + "] ");
    const std::array<int, 2> err = open();
    child.err = std::make_unique<LineForwarder>(err[0], STDERR_FILENO, "[" + name + "] ");
    const std::array<int, 2> channel = open();
    child.channel = std::make_unique<ChannelReader>(channel[0]);

    // Built before fork: between fork and exec only async-signal-safe calls are allowed.
    std::vector<std::string> env = shared_;
    if (!child.server && !child.evaluator) {
      env.push_back("RANK=" + std::to_string(rank));
      env.push_back("WORLD_SIZE=" + std::to_string(options_.processes));
      env.push_back("LOCAL_RANK=" + std::to_string(rank));
      env.push_back("LOCAL_WORLD_SIZE=" + std::to_string(options_.processes));
    }
    env.push_back("MASTER_ADDR=" + options_.host);
    env.push_back("MASTER_PORT=" + std::to_string(masterPort()));
    env.push_back("COHORT_LAUNCH_FD=" + std::to_string(kChannelFd));
    env.push_back("COHORT_RESTART_COUNT=" + std::to_string(restartsUsed_));
    if (child.restartedAlone) env.push_back("COHORT_RESTARTED_ALONE=1");
    if (usesTfConfig()) env.push_back("TF_CONFIG=" + tfConfig(index));
    std::vector<char*> envp;
    for (std::string& entry : env) envp.push_back(entry.data());
    envp.push_back(nullptr);
    std::vector<std::string> args = options_.command;
    std::vector<char*> argv;
    for (std::string& arg : args) argv.push_back(arg.data());
    argv.push_back(nullptr);

    // Signals stay blocked from fork until the child has put back the original dispositions, so
    // that the launcher's handler never runs in a child.
    sigset_t blocked;
    sigset_t original;
    sigemptyset(&blocked);
    for (int signo : kHandledSignals) sigaddset(&blocked, signo);
    ::sigprocmask(SIG_BLOCK, &blocked, &original);
    const pid_t launcher = ::getpid();
    const pid_t pid = ::fork();
    if (pid == 0) execChild(argv, envp, out[1], err[1], channel[1], launcher, original);
    const int forkErrno = errno;
    ::sigprocmask(SIG_SETMASK, &original, nullptr);
    for (int fd : {out[1], err[1], channel[1]}) ::close(fd);
    if (pid < 0) throw Error("launch: cannot start " + name + ": fork failed: " + errorText(forkErrno));
    child.pid = pid;
    child.running = true;
    ++running_;
  }

  [[noreturn]] void execChild(const std::vector<char*>& argv, const std::vector<char*>& envp, int outFd, int errFd,
                              int channelFd, pid_t launcher, const sigset_t& originalMask) {
    for (size_t i = 0; i < kHandledSignals.size(); ++i) ::sigaction(kHandledSignals[i], &originalActions_[i], nullptr);
    ::prctl(PR_SET_PDEATHSIG, SIGTERM);
    if (::getppid() != launcher) ::_exit(128 + SIGTERM);  // the launcher died before prctl
    ::sigprocmask(SIG_SETMASK, &originalMask, nullptr);
    ::dup2(outFd, STDOUT_FILENO);
    ::dup2(errFd, STDERR_FILENO);
    // The channel at fd 3 across exec (a shell's >&3 takes single digits only); every other
    // descriptor of the launcher is closed on exec.
    if (channelFd == kChannelFd) {
      ::fcntl(channelFd, F_SETFD, 0);
    } else {
      ::dup2(channelFd, kChannelFd);
    }
    ::execvpe(argv[0], argv.data(), envp.data());
    char message[512];
    const int length = std::snprintf(message, sizeof(message), "cohort launch: cannot run %s: %s\n", argv[0],
                                     std::strerror(errno));
    writeAll(STDERR_FILENO, std::string_view(message, size_t(std::clamp(length, 0, int(sizeof(message)) - 1))));
    ::_exit(127);
  }

  // Sleeps until output, a message, a signal or a child's exit arrives (or the grace period ends),
  // and handles what came.
  void waitForEvents() {
    std::vector<pollfd> fds{{signalPipeRead_, POLLIN, 0}};
    std::vector<Child*> owners{nullptr};
    std::vector<LineForwarder*> forwarders{nullptr};
    for (Child& child : children_) {
      for (LineForwarder* f : {child.out.get(), child.err.get()}) {
        if (f == nullptr || !f->isOpen()) continue;
        fds.push_back({f->fd(), POLLIN, 0});
        owners.push_back(&child);
        forwarders.push_back(f);
      }
      if (child.channel && child.channel->isOpen()) {
        fds.push_back({child.channel->fd(), POLLIN, 0});
        owners.push_back(&child);
        forwarders.push_back(nullptr);
      }
    }
    int timeoutMs = -1;
    if (ending_ && !killed_) {
      const auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline_ - Clock::now()).count();
      timeoutMs = int(std::clamp<int64_t>(left, 0, 1000 * 1000));
    } else if (usesTfConfig()) {
      timeoutMs = 200;  // to notice when the shards' grace period after the workers is over
    } else if (anyPending()) {
      const Clock::time_point next = portsNoticed_ ? portsDeadline_ : std::min(portsNoticeAt_, portsDeadline_);
      const auto left = std::chrono::ceil<std::chrono::milliseconds>(next - Clock::now()).count();
      timeoutMs = int(std::clamp<int64_t>(left, 0, 1000 * 1000));
    }
    if (::poll(fds.data(), fds.size(), timeoutMs) <= 0) return;  // EINTR: the self-pipe says why
    for (size_t i = 1; i < fds.size(); ++i) {
      if (fds[i].revents == 0) continue;
      if (forwarders[i] != nullptr) {
        forwarders[i]->readAvailable();
      } else {
        readChannel(*owners[i]);
      }
    }
  }

  // The messages of base/launcher_channel.h.
  void readChannel(Child& child) {
    if (!child.channel) return;
    for (const std::string& line : child.channel->readLines()) {
      const std::string_view text(line);
      const size_t space = text.find(' ');
      const std::string_view verb = text.substr(0, space);
      const std::string_view rest = space == std::string_view::npos ? "" : text.substr(space + 1);
      if (verb == "fault-policy" && !child.server && child.rank == 0) {
        if (auto loss = parseWorkerLoss(rest)) scheme_ = *loss;
      } else if (verb == "shard-checkpoints" && child.server) {
        child.writesCheckpoints = true;
      } else if (verb == "shard-has-checkpoint" && child.server) {
        child.hasCheckpoint = true;
      } else if (verb == "finished") {
        child.finished = true;
      } else if (verb == "error") {
        child.error = std::string(rest);
      } else if (verb == "port" && (child.server || (child.rank == 0 && !child.evaluator)) && child.port < 0) {
        // The first port counts: a shard restarted alone binds the one the workers know.
        int port = -1;
        if (rest == "none") {
          port = 0;
        } else {
          const auto [end, ec] = std::from_chars(rest.data(), rest.data() + rest.size(), port);
          if (ec != std::errc() || end != rest.data() + rest.size() || port < 1 || port > kMaxPort) port = -1;
        }
        child.port = port;
      }
    }
  }

  void handleSignals() {
    std::array<unsigned char, 64> bytes;
    ssize_t n = 0;
    while ((n = ::read(signalPipeRead_, bytes.data(), bytes.size())) > 0 || (n < 0 && errno == EINTR)) {
      for (ssize_t i = 0; i < n; ++i) {
        const int signo = bytes[size_t(i)];
        if (signo == SIGCHLD) continue;  // reapChildren() runs next anyway
        if (restartGroup_) {  // the user stops a job that was about to restart: it ends here
          restartGroup_ = false;
          say("got " + signalName(signo) + ", not restarting");
          exitCode_ = 128 + signo;
        }
        if (!ending_) {
          say("got " + signalName(signo) + ", stopping the ranks");
          exitCode_ = 128 + signo;
          endJob(signo);
        } else if (!killed_) {
          killRemaining();  // asked twice: do not wait out the grace period
        }
      }
    }
  }

  void reapChildren() {
    for (size_t i = 0; i < children_.size(); ++i) {
      Child& child = children_[i];
      if (!child.running) continue;
      int status = 0;
      const pid_t pid = ::waitpid(child.pid, &status, WNOHANG);
      if (pid != child.pid) continue;
      child.running = false;
      --running_;
      drain(child);  // what it wrote before exiting comes before the line about its exit
      const bool failed = !(WIFEXITED(status) && WEXITSTATUS(status) == 0);
      // One that ends well without telling a port listens on nothing: who waited for it goes on.
      if (!failed && child.port < 0) child.port = 0;
      if (failed && !ending_) onChildFailed(int(i), status);
    }
  }

  // The failure policy (cli/launch_policy.h) applied to child `index`, which just failed.
  void onChildFailed(int index, int status) {
    // What every process said before this exit counts (the chief's policy may be in its pipe still).
    for (Child& other : children_) readChannel(other);
    Child& child = children_[size_t(index)];
    if (child.evaluator) {  // evaluation is a side job: training goes on without it
      onEvaluatorFailed(index, status);
      return;
    }
    std::string what = child.label;
    int code = 0;
    if (WIFSIGNALED(status)) {
      const int signo = WTERMSIG(status);
      what += " was killed by signal " + std::to_string(signo) + " (" + signalName(signo) + ")";
      code = 128 + signo;
    } else {
      what += " exited with status " + std::to_string(WEXITSTATUS(status));
      code = WEXITSTATUS(status);
    }
    if (!child.error.empty()) what += ": " + child.error;
    const ProcessKind kind = child.server ? ProcessKind::kShard : child.rank == 0 ? ProcessKind::kChief
                                                                                  : ProcessKind::kWorker;
    const int restartsLeft = options_.maxRestarts - restartsUsed_;
    const FailedProcess failed{.kind = kind,
                               .scheme = scheme_,
                               .writesCheckpoints = child.writesCheckpoints,
                               .hasCheckpoint = child.hasCheckpoint,
                               .restartsLeft = restartsLeft,
                               .finished = child.finished};
    const FailureAction action = onFailure(failed);
    const std::string restart = "restart " + std::to_string(restartsUsed_ + 1) + " of " +
                                std::to_string(options_.maxRestarts);
    switch (action) {
      case FailureAction::kGoOn:
        say(what + "; the others go on without it (the scheme tolerates a lost worker)");
        lost_.push_back(child.label);
        return;
      case FailureAction::kRestartProcess:
        say(what + "; starting it again alone (" + restart + ")");
        ++restartsUsed_;
        child.restartedAlone = true;
        start(index);
        return;
      case FailureAction::kRestartGroup:
        // A shard that died before its first checkpoint, restarted alone, would have no state and
        // wait for the chief's Init, which a running chief never sends again: every worker would
        // fail after --timeout. So the group restarts, and the line says why.
        say(what + (shardDiedBeforeItsFirstCheckpoint(failed)
                        ? "; shard " + std::to_string(index - options_.processes) +
                              " restarted with no checkpoint to restore: restarting the group (it died before its "
                              "first checkpoint; the group starts afresh from what --checkpoint-dir holds)"
                        : std::string("; restarting every process from the newest checkpoint")) +
            " (" + restart + ")");
        ++restartsUsed_;
        restartGroup_ = true;
        endJob(SIGTERM);
        return;
      case FailureAction::kEndJob:
        break;
    }
    // The job ends. Under a scheme that survives lost workers, say why this loss is different.
    if (child.finished) {
      // Its run is over: nobody goes on or waits for it, and a restart would only repeat it.
    } else if (scheme_ != WorkerLoss::kStopsGroup && kind == ProcessKind::kChief) {
      what += "; the job cannot go on without its chief";
    } else if (scheme_ != WorkerLoss::kStopsGroup && kind == ProcessKind::kShard) {
      what += child.writesCheckpoints ? "; the workers cannot go on without it"
                                      : "; the workers cannot go on without it and it has no checkpoint to restart "
                                        "from (--checkpoint-dir)";
    }
    if (child.finished) {
      what += "; it had finished its run (its done event is written): not restarted, a restart would fail the same way";
    } else if (options_.maxRestarts > 0) {
      what += " (all " + std::to_string(options_.maxRestarts) + " restarts used)";
    }
    say(what);
    exitCode_ = code;
    endJob(SIGTERM);
  }

  // The evaluator is restarted alone when a signal killed it (an OOM kill, a kill by hand): it
  // resumes from its record, so no checkpoint is evaluated twice. One that exited with a status
  // gave its own verdict (bad options, a checkpoint that does not fit, its idle timeout), which a
  // restart would repeat. Either way the workers go on.
  void onEvaluatorFailed(int index, int status) {
    Child& child = children_[size_t(index)];
    std::string what = child.label;
    if (WIFSIGNALED(status)) {
      what += " was killed by signal " + std::to_string(WTERMSIG(status)) + " (" + signalName(WTERMSIG(status)) + ")";
    } else {
      what += " exited with status " + std::to_string(WEXITSTATUS(status));
    }
    if (!child.error.empty()) what += ": " + child.error;
    if (WIFSIGNALED(status) && evaluatorRestarts_ < kEvaluatorRestarts) {
      ++evaluatorRestarts_;
      say(what + "; starting it again, it goes on from its record (evaluator restart " +
          std::to_string(evaluatorRestarts_) + " of " + std::to_string(kEvaluatorRestarts) + "); the workers go on");
      start(index);
      return;
    }
    if (WIFSIGNALED(status)) what += " (all " + std::to_string(kEvaluatorRestarts) + " evaluator restarts used)";
    say(what + "; the workers go on");
  }

  // Reads what an exited child left in its pipes (bounded: a grandchild may still be writing).
  void drain(Child& child) {
    for (LineForwarder* f : {child.out.get(), child.err.get()}) {
      for (int i = 0; i < 16 && f != nullptr && f->readAvailable(); ++i) {
      }
    }
    readChannel(child);
  }

  void closePipes(Child& child) {
    if (child.out) {
      drain(child);
      child.out->close();
      child.err->close();
    }
    if (child.channel) child.channel->close();
  }

  void endJob(int signo) {
    ending_ = true;
    deadline_ = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                   std::chrono::duration<double>(options_.graceSeconds));
    for (const Child& child : children_) {
      if (child.running) ::kill(child.pid, signo);
    }
  }

  void killRemaining() {
    killed_ = true;
    for (const Child& child : children_) {
      if (child.running) ::kill(child.pid, SIGKILL);
    }
  }

  const LaunchOptions& options_;
  std::vector<std::string> shared_;  // the environment every child shares
  Clock::time_point portsDeadline_;  // for every listener of this group to tell its port
  Clock::time_point portsNoticeAt_;  // when to say whom the launcher is waiting for
  bool portsNoticed_ = false;        // said it (once per group)
  bool workersDone_ = false;
  bool serversStopped_ = false;
  Clock::time_point serversDeadline_;
  std::vector<Child> children_;
  int running_ = 0;
  int exitCode_ = 0;
  bool ending_ = false;  // a child failed or a signal came: the others are being stopped
  bool killed_ = false;  // the remaining children got SIGKILL
  Clock::time_point deadline_;
  // The failure policy's state.
  WorkerLoss scheme_ = WorkerLoss::kStopsGroup;  // as the chief said; kept across restarts
  int restartsUsed_ = 0;
  bool restartGroup_ = false;    // once every child has exited, start the group again
  int evaluatorRestarts_ = 0;     // the evaluator's, counted apart from --max-restarts
  std::vector<std::string> lost_;  // workers the job went on without
  int signalPipeRead_ = -1;
  bool handlersInstalled_ = false;
  std::array<struct sigaction, kHandledSignals.size()> originalActions_{};
};

// Refuses a --host that does not resolve or is not an address of this machine, before anything is
// started: binds port 0 there and closes the socket at once (nobody is handed that port).
void checkLocalHost(const std::string& host) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  addrinfo* found = nullptr;
  const int rc = ::getaddrinfo(host.c_str(), "0", &hints, &found);
  COHORT_CHECK(rc == 0, InvalidArgument, "--host ", host, ": cannot resolve it: ", ::gai_strerror(rc));
  std::unique_ptr<addrinfo, decltype(&::freeaddrinfo)> guard(found, ::freeaddrinfo);
  std::string lastError = "no address";
  for (const addrinfo* a = found; a != nullptr; a = a->ai_next) {
    const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) {
      lastError = errorText(errno);
      continue;
    }
    const bool bound = ::bind(fd, a->ai_addr, a->ai_addrlen) == 0;
    if (!bound) lastError = errorText(errno);
    ::close(fd);
    if (bound) return;
  }
  throw InvalidArgument("--host " + host + ": cannot open a port there (" + lastError +
                        "); give an address of this machine");
}

// Refuses, before anything is forked, a job with more processes than this machine can hold.
void checkProcessCount(const LaunchOptions& options) {
  const long total = long(options.processes) + long(options.parameterServers);
  long limit = kMaxProcesses;
  std::string why = "the launcher's cap for one machine";
  rlimit nproc{};
  if (::getrlimit(RLIMIT_NPROC, &nproc) == 0 && nproc.rlim_cur != RLIM_INFINITY && long(nproc.rlim_cur) / 2 < limit) {
    limit = std::max(1L, long(nproc.rlim_cur) / 2);
    why = "half of this user's process limit, RLIMIT_NPROC = " + std::to_string(nproc.rlim_cur);
  }
  COHORT_CHECK(total <= limit, InvalidArgument, "-n ", options.processes, " with --ps ", options.parameterServers,
               " is ", total, " processes, more than ", limit, " (", why,
               "): use fewer processes per machine, and several machines (mpirun, srun, TF_CONFIG) for more");
}

}  // namespace

int runLaunch(const LaunchOptions& options) {
  COHORT_CHECK(options.processes >= 1, InvalidArgument, "-n/--nproc must be at least 1 (got ", options.processes, ")");
  COHORT_CHECK(!options.command.empty(), InvalidArgument,
               "no command to launch: give it after --, as in cohort launch -n 2 -- cohort train");
  COHORT_CHECK(options.port >= 0 && options.port <= kMaxPort, InvalidArgument,
               "--port must be between 0 and 65535 (0 picks a free port), got ", options.port);
  COHORT_CHECK(std::isfinite(options.graceSeconds) && options.graceSeconds >= 0, InvalidArgument,
               "--grace must be a number of seconds >= 0, got ", options.graceSeconds);
  COHORT_CHECK(!options.host.empty(), InvalidArgument, "--host must not be empty");
  COHORT_CHECK(options.parameterServers >= 0, InvalidArgument, "--ps must not be negative, got ",
               options.parameterServers);
  COHORT_CHECK(options.maxRestarts >= 0, InvalidArgument, "--max-restarts must not be negative, got ",
               options.maxRestarts);
  checkProcessCount(options);
  checkLocalHost(options.host);
  Launcher launcher(options);
  return launcher.run();
}

}  // namespace cohort::cli
