#include "base/subprocess.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <thread>

extern char** environ;

namespace cohort {

namespace {

// Everything the child needs, built before fork: after it, only async-signal-safe calls.
struct ChildPlan {
  std::vector<std::string> argv;
  std::vector<std::string> env;
  std::vector<char*> argvPointers;
  std::vector<char*> envPointers;
  const char* program = nullptr;           // nullptr: execvpe(argv[0])
  std::vector<std::pair<int, int>> moves;  // (the child's descriptor, the parent's descriptor to copy there)
  std::vector<int> childEnds;              // the pipe ends and /dev/null the parent closes after fork
  std::map<int, int> parentEnds;           // the child's descriptor -> the parent's end of its pipe
  pid_t group = kParentGroup;
  int deathSignal = 0;
  pid_t parent = -1;
  bool clearMask = false;
  sigset_t mask{};            // the parent's, restored after fork; the child's unless clearMask
  std::string failurePrefix;  // "PREFIX cannot run ARGV0: "; empty with no prefix option
  bool childSaysFailure = false;
  int reportFd = -1;  // the write end the child reports a failed exec's errno on (close-on-exec)

  ~ChildPlan() {
    for (int fd : childEnds) ::close(fd);
    for (const auto& [childFd, fd] : parentEnds) ::close(fd);
    if (reportFd >= 0) ::close(reportFd);
  }
};

std::string reason(int error) { return std::strerror(error); }

std::array<int, 2> makePipe() {
  std::array<int, 2> fds{-1, -1};
  if (::pipe2(fds.data(), O_CLOEXEC) != 0) throw SubprocessError("cannot create a pipe: " + reason(errno));
  return fds;
}

bool isUnset(const std::string& name, const std::vector<std::string>& unset) {
  return std::any_of(unset.begin(), unset.end(), [&](const std::string& pattern) {
    if (!pattern.empty() && pattern.back() == '*') return name.rfind(pattern.substr(0, pattern.size() - 1), 0) == 0;
    return name == pattern;
  });
}

std::vector<std::string> childEnvironment(const SubprocessOptions& options) {
  std::vector<std::string> env;
  for (char** entry = environ; *entry != nullptr; ++entry) {
    const std::string text(*entry);
    const std::string name = text.substr(0, text.find('='));
    if (!isUnset(name, options.unsetEnv) && !options.setEnv.count(name)) env.push_back(text);
  }
  for (const auto& [name, value] : options.setEnv) env.push_back(name + "=" + value);
  return env;
}

// Writes a kPipe stdin's starting text into the pipe before the child exists: it must fit.
void fillInput(int writeEnd, const std::string& input) {
  if (input.empty()) return;
  const int flags = ::fcntl(writeEnd, F_GETFL);
  ::fcntl(writeEnd, F_SETFL, flags | O_NONBLOCK);
  const ssize_t n = ::write(writeEnd, input.data(), input.size());
  ::fcntl(writeEnd, F_SETFL, flags);
  if (n != ssize_t(input.size())) throw SubprocessError("its input does not fit a pipe");
}

// Where the child's descriptor `childFd` comes from; -1: left as it is.
int sourceOf(ChildPlan& plan, int childFd, const ChildStream& stream, int stdoutSource) {
  switch (stream.kind) {
    case ChildStream::Kind::kInherit: return -1;
    case ChildStream::Kind::kFd: return stream.fd;
    case ChildStream::Kind::kStdout: return stdoutSource < 0 ? STDOUT_FILENO : stdoutSource;
    case ChildStream::Kind::kNull: {
      const int fd = ::open("/dev/null", (childFd == STDIN_FILENO ? O_RDONLY : O_WRONLY) | O_CLOEXEC);
      if (fd < 0) throw SubprocessError("cannot open /dev/null: " + reason(errno));
      plan.childEnds.push_back(fd);
      return fd;
    }
    case ChildStream::Kind::kPipe: {
      const std::array<int, 2> fds = makePipe();
      const bool childReads = childFd == STDIN_FILENO;
      plan.childEnds.push_back(fds[childReads ? 0 : 1]);
      plan.parentEnds[childFd] = fds[childReads ? 1 : 0];
      if (childReads) fillInput(fds[1], stream.input);
      return fds[childReads ? 0 : 1];
    }
  }
  return -1;
}

void planDescriptors(ChildPlan& plan, const SubprocessOptions& options) {
  auto add = [&](int childFd, const ChildStream& stream, int stdoutSource) {
    const int source = sourceOf(plan, childFd, stream, stdoutSource);
    if (source >= 0) plan.moves.emplace_back(childFd, source);
    return source;
  };
  add(STDIN_FILENO, options.in, -1);
  const int stdoutSource = add(STDOUT_FILENO, options.out, -1);
  add(STDERR_FILENO, options.err, stdoutSource);
  for (const auto& [childFd, stream] : options.extra) add(childFd, stream, stdoutSource);
}

ChildPlan planChild(const SubprocessOptions& options) {
  if (options.argv.empty()) throw SubprocessError("cannot run a program: no argv");
  ChildPlan plan;
  plan.argv = options.argv;
  for (std::string& word : plan.argv) plan.argvPointers.push_back(word.data());
  plan.argvPointers.push_back(nullptr);
  plan.env = childEnvironment(options);
  for (std::string& entry : plan.env) plan.envPointers.push_back(entry.data());
  plan.envPointers.push_back(nullptr);
  plan.program = options.program.empty() ? nullptr : options.program.c_str();
  planDescriptors(plan, options);
  plan.group = options.processGroup;
  plan.deathSignal = options.parentDeathSignal;
  plan.parent = ::getpid();
  plan.clearMask = options.clearSignalMask;
  plan.childSaysFailure = options.execFailurePrefix.has_value();
  const std::string& shown = options.program.empty() ? options.argv[0] : options.program;
  if (plan.childSaysFailure) plan.failurePrefix = *options.execFailurePrefix + "cannot run " + shown + ": ";
  return plan;
}

// ---- In the child, between fork and exec: async-signal-safe calls only ----

void resetSignalHandlers() {
  for (int signo = 1; signo < NSIG; ++signo) {
    struct sigaction action {};
    if (::sigaction(signo, nullptr, &action) != 0) continue;
    if (action.sa_handler == SIG_DFL || action.sa_handler == SIG_IGN) continue;
    action.sa_handler = SIG_DFL;
    action.sa_flags = 0;
    ::sigaction(signo, &action, nullptr);
  }
}

// Puts each source at its descriptor. Every source is first copied above every target, so that one
// move never overwrites the source of a later one.
void placeDescriptors(const ChildPlan& plan) {
  int highest = 2;
  for (const auto& [target, source] : plan.moves) highest = std::max(highest, target);
  std::array<int, 64> copies{};
  const size_t n = std::min(plan.moves.size(), copies.size());
  for (size_t i = 0; i < n; ++i) copies[i] = ::fcntl(plan.moves[i].second, F_DUPFD_CLOEXEC, highest + 1);
  for (size_t i = 0; i < n; ++i) ::dup2(copies[i], plan.moves[i].first);  // the copy at target is inheritable
  for (size_t i = 0; i < n; ++i) ::close(copies[i]);
}

[[noreturn]] void failExec(const ChildPlan& plan, int error) {
  if (!plan.childSaysFailure) {
    [[maybe_unused]] ssize_t n = ::write(plan.reportFd, &error, sizeof error);
    ::_exit(127);
  }
  // One write, so that the line stays whole in a log other processes append to.
  char line[1024];
  size_t length = 0;
  for (const char* part : std::array<const char*, 2>{plan.failurePrefix.c_str(), ::strerror(error)}) {
    const size_t size = std::min(std::strlen(part), sizeof line - 1 - length);
    std::memcpy(line + length, part, size);
    length += size;
  }
  line[length++] = '\n';
  [[maybe_unused]] ssize_t n = ::write(STDERR_FILENO, line, length);
  ::_exit(127);
}

[[noreturn]] void becomeChild(const ChildPlan& plan) {
  if (plan.group != kParentGroup) ::setpgid(0, plan.group);
  if (plan.deathSignal != 0) {
    ::prctl(PR_SET_PDEATHSIG, plan.deathSignal);
    if (::getppid() != plan.parent) ::_exit(128 + plan.deathSignal);  // the parent died before prctl
  }
  resetSignalHandlers();
  sigset_t none;
  sigemptyset(&none);
  ::pthread_sigmask(SIG_SETMASK, plan.clearMask ? &none : &plan.mask, nullptr);
  placeDescriptors(plan);
  if (plan.program != nullptr) {
    ::execve(plan.program, plan.argvPointers.data(), plan.envPointers.data());
  } else {
    ::execvpe(plan.argvPointers[0], plan.argvPointers.data(), plan.envPointers.data());
  }
  failExec(plan, errno);
}

// ---- In the parent ----

// With no prefix, the child reports a failed exec's errno on a close-on-exec pipe: end of file
// without one means the exec happened.
int readExecFailure(int reportRead) {
  int error = 0;
  ssize_t n = 0;
  while ((n = ::read(reportRead, &error, sizeof error)) < 0 && errno == EINTR) {
  }
  ::close(reportRead);
  return n == ssize_t(sizeof error) ? error : 0;
}

int msUntil(IoClock::time_point deadline) {
  const auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - IoClock::now()).count();
  return int(std::clamp<int64_t>(left, 0, 1000 * 1000));
}

constexpr size_t kChunk = 4096;

// Appends at most `most` bytes of what has come on `from`, waiting until `deadline` for a first one.
IoStatus readChunk(int from, std::string& out, IoClock::time_point deadline, size_t most) {
  if (from < 0) return IoStatus::kClosed;
  for (;;) {
    pollfd p{from, POLLIN, 0};
    const int ready = ::poll(&p, 1, msUntil(deadline));
    if (ready < 0 && errno == EINTR) continue;
    if (ready < 0) return IoStatus::kError;
    if (ready == 0) return IoStatus::kTimeout;
    char chunk[kChunk];
    const ssize_t got = ::read(from, chunk, std::min(most, sizeof chunk));
    if (got < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    if (got < 0) return IoStatus::kError;
    if (got == 0) return IoStatus::kClosed;
    out.append(chunk, size_t(got));
    return IoStatus::kOk;
  }
}

}  // namespace

bool ExitStatus::exited() const { return WIFEXITED(raw); }
int ExitStatus::code() const { return WIFEXITED(raw) ? WEXITSTATUS(raw) : -1; }
bool ExitStatus::signaled() const { return WIFSIGNALED(raw); }
int ExitStatus::signal() const { return WIFSIGNALED(raw) ? WTERMSIG(raw) : 0; }
int ExitStatus::shellCode() const { return exited() ? code() : 128 + signal(); }

std::string signalName(int signo) {
  const char* abbrev = ::sigabbrev_np(signo);
  return abbrev != nullptr ? std::string("SIG") + abbrev : "unknown signal";
}

Subprocess Subprocess::spawn(const SubprocessOptions& options) {
  ChildPlan plan = planChild(options);
  int reportRead = -1;
  if (!plan.childSaysFailure) {
    const std::array<int, 2> report = makePipe();
    reportRead = report[0];
    plan.reportFd = report[1];
  }
  sigset_t all;
  sigfillset(&all);
  ::pthread_sigmask(SIG_BLOCK, &all, &plan.mask);  // no handler of the parent's may run in the child
  const pid_t pid = ::fork();
  if (pid == 0) becomeChild(plan);
  const int forkError = errno;
  ::pthread_sigmask(SIG_SETMASK, &plan.mask, nullptr);
  if (pid < 0) {
    if (reportRead >= 0) ::close(reportRead);
    throw SubprocessError("fork failed: " + reason(forkError));
  }
  Subprocess child;
  child.pid_ = pid;
  if (plan.group != kParentGroup) {
    child.group_ = plan.group == kNewGroup ? pid : plan.group;
    ::setpgid(pid, child.group_);  // here too, so that a signal to the group right after cannot miss it
  }
  std::swap(child.fds_, plan.parentEnds);
  if (reportRead >= 0) {
    ::close(plan.reportFd);
    plan.reportFd = -1;
    if (const int error = readExecFailure(reportRead); error != 0) {
      child.wait();
      throw SubprocessError("cannot run " + (options.program.empty() ? options.argv[0] : options.program) + ": " +
                            reason(error));
    }
  }
  return child;
}

Subprocess Subprocess::fork(const std::function<int()>& body) {
  const pid_t pid = ::fork();
  if (pid < 0) throw SubprocessError("fork failed: " + reason(errno));
  if (pid == 0) {
    int code = 1;
    try {
      code = body();
    } catch (...) {
    }
    ::_exit(code);
  }
  Subprocess child;
  child.pid_ = pid;
  return child;
}

Subprocess::Subprocess(Subprocess&& other) noexcept
    : pid_(std::exchange(other.pid_, -1)),
      group_(std::exchange(other.group_, 0)),
      status_(std::exchange(other.status_, std::nullopt)),
      fds_(std::exchange(other.fds_, {})) {}

Subprocess& Subprocess::operator=(Subprocess&& other) noexcept {
  if (this != &other) {
    reset();
    pid_ = std::exchange(other.pid_, -1);
    group_ = std::exchange(other.group_, 0);
    status_ = std::exchange(other.status_, std::nullopt);
    fds_ = std::exchange(other.fds_, {});
  }
  return *this;
}

Subprocess::~Subprocess() { reset(); }

void Subprocess::reset() {
  if (running()) {
    ::kill(pid_, SIGKILL);
    wait();
  }
  for (const auto& [childFd, fd] : fds_) ::close(fd);
  fds_.clear();
  pid_ = -1;
  group_ = 0;
  status_.reset();
}

int Subprocess::fd(int childFd) const {
  const auto it = fds_.find(childFd);
  return it == fds_.end() ? -1 : it->second;
}

int Subprocess::releaseFd(int childFd) {
  const int out = fd(childFd);
  fds_.erase(childFd);
  return out;
}

void Subprocess::closeFd(int childFd) {
  const int fd = releaseFd(childFd);
  if (fd >= 0) ::close(fd);
}

std::optional<ExitStatus> Subprocess::tryWait() {
  if (status_ || pid_ <= 0) return status_;
  int raw = 0;
  pid_t got = 0;
  while ((got = ::waitpid(pid_, &raw, WNOHANG)) < 0 && errno == EINTR) {
  }
  if (got < 0) throwNotReapable();
  if (got == pid_) status_ = ExitStatus{raw};
  return status_;
}

void Subprocess::throwNotReapable() const {
  // ECHILD: no such child, as when SIGCHLD is ignored and the kernel reaped it. Not "exit 0".
  throw Error(detail::concat("cannot learn how process ", pid_, " ended: waitpid: ", std::strerror(errno),
                             errno == ECHILD
                                 ? " (SIGCHLD is ignored in this process, so the kernel reaps its children: "
                                   "run it with SIGCHLD at its default)"
                                 : ""));
}

std::optional<ExitStatus> Subprocess::waitUntil(IoClock::time_point deadline) {
  // A pidfd becomes readable when the process exits (Linux 5.3); without one, look every 10 ms.
  const int pidfd = int(::syscall(SYS_pidfd_open, pid_, 0));
  while (!tryWait() && pid_ > 0) {
    const int ms = msUntil(deadline);
    if (ms == 0) break;
    if (pidfd >= 0) {
      pollfd p{pidfd, POLLIN, 0};
      ::poll(&p, 1, ms);
    } else {
      std::this_thread::sleep_for(std::chrono::milliseconds(std::min(ms, 10)));
    }
  }
  if (pidfd >= 0) ::close(pidfd);
  return status_;
}

ExitStatus Subprocess::wait() {
  if (status_ || pid_ <= 0) return status_.value_or(ExitStatus{});
  int raw = 0;
  pid_t got = 0;
  while ((got = ::waitpid(pid_, &raw, 0)) < 0 && errno == EINTR) {
  }
  if (got < 0) throwNotReapable();
  status_ = ExitStatus{raw};
  return *status_;
}

void Subprocess::signal(int signo) const {
  if (running()) ::kill(pid_, signo);
}

void Subprocess::signalGroup(int signo) const {
  if (group_ > 0) ::kill(-group_, signo);
}

IoStatus Subprocess::readSome(std::string& out, IoClock::time_point deadline, int childFd) {
  return readChunk(fd(childFd), out, deadline, kChunk);
}

CapturedRun runCapturingOutput(const std::vector<std::string>& argv, std::chrono::seconds timeout, size_t limit) {
  Subprocess child = Subprocess::spawn({.argv = argv,
                                        .in = ChildStream::null(),
                                        .out = ChildStream::pipe(),
                                        .err = ChildStream::sameAsStdout(),
                                        .processGroup = kNewGroup,
                                        .parentDeathSignal = SIGKILL});
  const auto deadline = IoClock::now() + timeout;
  CapturedRun run;
  child.readOutput(run.output, deadline, limit);
  child.closeFd(STDOUT_FILENO);  // past the limit, it gets SIGPIPE rather than blocking
  run.status = child.waitUntil(deadline);
  if (!run.status) {
    child.signalGroup(SIGKILL);
    child.wait();
  }
  return run;
}

IoStatus Subprocess::readOutput(std::string& out, IoClock::time_point deadline, size_t limit, int childFd) {
  for (size_t left = limit; left > 0;) {
    const size_t before = out.size();
    const IoStatus status = readChunk(fd(childFd), out, deadline, std::min(left, kChunk));
    if (status != IoStatus::kOk) return status;
    left -= out.size() - before;
  }
  return IoStatus::kOk;
}

}  // namespace cohort
