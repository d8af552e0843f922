// `cohort launch`'s supervision (cli/launch.h): the job's processes started in the order their
// ports allow, one poll loop over their pipes and the signals, the failure policy applied to each
// exit (go on, restart one, restart the group, end the job), and the job's end. The children's
// pipes and process handling are in launch_children, their output in launch_output, their
// environment in launch_environment.
#include "cli/launch.h"

#include "cli/launch_children.h"
#include "cli/launch_environment.h"
#include "cli/launch_output.h"
#include "cli/launch_policy.h"

#include <cohort/error.h>

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

namespace cohort::cli {
namespace {

using Clock = std::chrono::steady_clock;

// More processes than any one machine trains with; RLIMIT_NPROC may lower it.
constexpr long kMaxProcesses = 1024;
// Descriptors the launcher keeps besides its children's pipes (standard streams, the signal pipe,
// the listening check, a child's pipes while it starts).
constexpr long kFilesKept = 24;
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

// The self-pipe of the signal handlers: both ends closed on exec and non-blocking.
std::array<int, 2> openSignalPipe() {
  std::array<int, 2> fds{-1, -1};
  if (::pipe2(fds.data(), O_CLOEXEC | O_NONBLOCK) != 0) {
    throw Error("launch: cannot create a pipe for signals: " + errorText(errno));
  }
  return fds;
}

class Launcher {
 public:
  explicit Launcher(const LaunchOptions& options) : options_(options) {}
  Launcher(const Launcher&) = delete;
  Launcher& operator=(const Launcher&) = delete;

  // On the way out (normally or by an exception) no child is left running or unreaped.
  ~Launcher() {
    children_.clear();  // a LaunchedChild's process is killed and reaped with it
    restoreSignalHandlers();
  }

  int run() {
    installSignalHandlers();
    shared_ = sharedChildEnv(options_.processes);
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
    return std::any_of(children_.begin(), children_.end(), [](const LaunchedChild& c) { return c.pending; });
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
      const LaunchedChild& child = children_[size_t(i)];
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
        for (const LaunchedChild& child : children_) {
          if (child.running()) {
            say(child.label + " did not stop within " + formatSeconds(options_.graceSeconds) +
                " s, killing it");
          }
        }
        killRemaining();
      }
    }
    // Every child has exited: forward what they wrote last and stop listening, even if a
    // grandchild still holds a pipe open.
    for (LaunchedChild& child : children_) closePipes(child, scheme_);
  }

  void installSignalHandlers() {
    const std::array<int, 2> fds = openSignalPipe();
    signalPipeRead_ = fds[0];
    signalPipeWrite = fds[1];
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

  // Shards end on their own once every worker said it is done; one that has not within the grace
  // period after the last worker exited is stopped.
  void stopServersAfterWorkers() {
    if (options_.parameterServers == 0 || ending_) return;
    for (const LaunchedChild& child : children_) {
      if (!child.server && !child.evaluator && (child.running() || child.pending)) return;
    }
    if (!workersDone_) {
      workersDone_ = true;
      serversDeadline_ = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                            std::chrono::duration<double>(std::max(options_.graceSeconds, 1.0)));
      return;
    }
    if (Clock::now() < serversDeadline_ || serversStopped_) return;
    serversStopped_ = true;
    for (const LaunchedChild& child : children_) {
      if (child.server && child.running()) child.process.signalGroup(SIGTERM);
    }
  }

  // Starts (or starts again) process `index` with its environment and fresh pipes.
  void start(int index) {
    LaunchedChild& child = children_[size_t(index)];
    closePipes(child, scheme_);
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
    EnvChanges env = shared_;
    const ChildPlace place{
        .index = index, .server = child.server, .evaluator = child.evaluator, .restartedAlone = child.restartedAlone};
    for (auto& [name, value] : childEnv(options_, place, ports(), restartsUsed_)) env[name] = value;
    startChild(child, options_.command, env);
    ++running_;
  }

  JobPorts ports() const {
    JobPorts out;
    out.master = masterPort();
    for (int k = 0; k < options_.parameterServers; ++k) out.shards.push_back(children_[size_t(shardIndex(k))].port);
    return out;
  }

  // Sleeps until output, a message, a signal or a child's exit arrives (or the grace period ends),
  // and handles what came.
  void waitForEvents() {
    std::vector<pollfd> fds{{signalPipeRead_, POLLIN, 0}};
    std::vector<LaunchedChild*> owners{nullptr};
    std::vector<LineForwarder*> forwarders{nullptr};
    for (LaunchedChild& child : children_) {
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
        readChannel(*owners[i], scheme_);
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
      LaunchedChild& child = children_[i];
      if (!child.running()) continue;
      const std::optional<ExitStatus> status = child.process.tryWait();
      if (!status) continue;
      // What it started and left running ends with it (its group's id is not reused while they
      // live, so this reaches them and no one else).
      child.process.signalGroup(SIGKILL);
      --running_;
      drain(child, scheme_);  // what it wrote before exiting comes before the line about its exit
      const bool failed = !status->ok();
      // One that ends well without telling a port listens on nothing: who waited for it goes on.
      if (!failed && child.port < 0) child.port = 0;
      // A server this launcher stopped with SIGTERM once the workers were done (a shard served by
      // the library's serveParameterServerShard, which leaves SIGTERM to its process) ended as
      // asked, not in failure.
      const bool stoppedAsAsked = child.server && serversStopped_ && status->signal() == SIGTERM;
      if (failed && !ending_ && !stoppedAsAsked) onChildFailed(int(i), *status);
      // A process that refused its input (status 2) while the job was ending is the cause, and a
      // rank that lost it first (status 1) only the consequence: the job says so with 2.
      if (failed && ending_ && !killed_ && !status->signaled() && status->code() == 2 && exitCode_ == 1) {
        exitCode_ = 2;
        say(child.label + " exited with status 2" + (child.error.empty() ? "" : ": " + child.error));
      }
    }
  }

  // The failure policy (cli/launch_policy.h) applied to child `index`, which just failed.
  void onChildFailed(int index, const ExitStatus& status) {
    // What every process said before this exit counts (the chief's policy may be in its pipe still).
    for (LaunchedChild& other : children_) readChannel(other, scheme_);
    LaunchedChild& child = children_[size_t(index)];
    if (child.evaluator) {  // evaluation is a side job: training goes on without it
      onEvaluatorFailed(index, status);
      return;
    }
    std::string what = child.label;
    if (status.signaled()) {
      const int signo = status.signal();
      what += " was killed by signal " + std::to_string(signo) + " (" + signalName(signo) + ")";
    } else {
      what += " exited with status " + std::to_string(status.code());
    }
    const int code = status.shellCode();
    if (!child.error.empty()) what += ": " + child.error;
    // Once every worker is done a shard serves no one: a restarted one would wait for workers that
    // never come, and the launcher, having stopped the servers, would not stop it again. The job
    // fails with its status (its last checkpoint may be what failed); the others stop as usual.
    if (child.server && workersDone_) {
      say(what + "; every worker had finished, so it is not restarted");
      exitCode_ = code;
      return;
    }
    // Status 2 is a refusal of the command's input (cohort's usage errors): a restart would be
    // refused the same way, or worse, run otherwise (a restart resumes: a new run refused beside an
    // earlier run's checkpoints would take that run up). The job ends with it.
    if (status.exited() && status.code() == 2 && options_.maxRestarts > 0) {
      say(what + "; it refused its input, which a restart would not change: not restarted");
      exitCode_ = code;
      endJob(SIGTERM);
      return;
    }
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
  void onEvaluatorFailed(int index, const ExitStatus& status) {
    LaunchedChild& child = children_[size_t(index)];
    std::string what = child.label;
    if (status.signaled()) {
      what += " was killed by signal " + std::to_string(status.signal()) + " (" + signalName(status.signal()) + ")";
    } else {
      what += " exited with status " + std::to_string(status.code());
    }
    if (!child.error.empty()) what += ": " + child.error;
    if (status.signaled() && evaluatorRestarts_ < kEvaluatorRestarts) {
      ++evaluatorRestarts_;
      say(what + "; starting it again, it goes on from its record (evaluator restart " +
          std::to_string(evaluatorRestarts_) + " of " + std::to_string(kEvaluatorRestarts) + "); the workers go on");
      start(index);
      return;
    }
    if (status.signaled()) what += " (all " + std::to_string(kEvaluatorRestarts) + " evaluator restarts used)";
    say(what + "; the workers go on");
  }

  void endJob(int signo) {
    ending_ = true;
    deadline_ = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                   std::chrono::duration<double>(options_.graceSeconds));
    for (const LaunchedChild& child : children_) {
      if (child.running()) child.process.signalGroup(signo);
    }
  }

  void killRemaining() {
    killed_ = true;
    for (const LaunchedChild& child : children_) {
      if (child.running()) child.process.signalGroup(SIGKILL);
    }
  }

  const LaunchOptions& options_;
  EnvChanges shared_;                // what every child's environment shares
  Clock::time_point portsDeadline_;  // for every listener of this group to tell its port
  Clock::time_point portsNoticeAt_;  // when to say whom the launcher is waiting for
  bool portsNoticed_ = false;        // said it (once per group)
  bool workersDone_ = false;
  bool serversStopped_ = false;
  Clock::time_point serversDeadline_;
  std::vector<LaunchedChild> children_;
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
  // Three pipes a child stay open here (stdout, stderr, the channel), and a few more while one
  // starts: the soft limit on open files is raised as far as the job needs (the hard limit at
  // most; the children inherit it), and what it allows caps the job.
  rlimit files{};
  if (::getrlimit(RLIMIT_NOFILE, &files) == 0) {
    const long children = total + (options.evaluator ? 1 : 0);
    const rlim_t needed = rlim_t(kFilesKept + 3 * children);
    if (files.rlim_cur != RLIM_INFINITY && files.rlim_cur < needed) {
      rlimit raised = files;
      raised.rlim_cur = files.rlim_max == RLIM_INFINITY || files.rlim_max > needed ? needed : files.rlim_max;
      if (::setrlimit(RLIMIT_NOFILE, &raised) == 0) files = raised;
    }
    if (files.rlim_cur != RLIM_INFINITY && (long(files.rlim_cur) - kFilesKept) / 3 < std::min(limit, children)) {
      limit = std::max(0L, (long(files.rlim_cur) - kFilesKept) / 3 - (options.evaluator ? 1 : 0));
      why = "3 pipes a process under this user's open-file limit, RLIMIT_NOFILE = " + std::to_string(files.rlim_cur) +
            " (ulimit -n)";
    }
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
