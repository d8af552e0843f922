// Child processes: a program started with its descriptors, environment, process group and signals
// arranged (or a function run in a fork), waited for with a deadline, signalled alone or with its
// group, and its output read with a bound. Every fork/exec of cohort goes through here.
// Torch-free; no threads.
//
// The contract:
//
// Starting. spawn() blocks every signal around fork, so no handler of the parent's runs in the
// child; the child resets every handled signal to its default (as exec would), sets its signal
// mask (the parent's, or none), joins its process group, arranges its descriptors and execs.
// Between fork and exec it makes only async-signal-safe calls, so the parent may have threads.
// Every descriptor the parent opens here is close-on-exec; the child keeps 0, 1, 2, the `extra`
// ones and what the parent left inheritable.
//
// Ending. A Subprocess not yet waited for is killed (SIGKILL to the process alone) and reaped when
// it is destroyed: no child outlives its handle unreaped, even when an exception unwinds.
#pragma once

#include "base/socket_io.h"

#include <cohort/error.h>

#include <sys/types.h>

#include <chrono>
#include <cstddef>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace cohort {

// What one descriptor of the child is.
struct ChildStream {
  enum class Kind {
    kInherit,  // the parent's own descriptor of that number
    kNull,     // /dev/null
    kPipe,     // a new pipe; the parent's end is Subprocess::fd(n)
    kFd,       // a copy of the parent's descriptor `fd`
    kStdout,   // the same as the child's standard output (2>&1); for stderr only
  };
  Kind kind = Kind::kInherit;
  int fd = -1;
  // kPipe on standard input: what the pipe holds when the child starts (at most a pipe's
  // capacity, 64 KiB on Linux). The parent's write end stays open until closeFd(0).
  std::string input;

  static ChildStream inherit() { return {}; }
  static ChildStream null() { return make(Kind::kNull, -1, {}); }
  static ChildStream pipe(std::string input = {}) { return make(Kind::kPipe, -1, std::move(input)); }
  static ChildStream copyOf(int fd) { return make(Kind::kFd, fd, {}); }
  static ChildStream sameAsStdout() { return make(Kind::kStdout, -1, {}); }

 private:
  static ChildStream make(Kind kind, int fd, std::string input) {
    ChildStream stream;
    stream.kind = kind;
    stream.fd = fd;
    stream.input = std::move(input);
    return stream;
  }
};

// SubprocessOptions::processGroup: the parent's group, a new one led by the child, or (a pid) the
// group of that earlier child.
constexpr pid_t kParentGroup = -1;
constexpr pid_t kNewGroup = 0;

struct SubprocessOptions {
  std::vector<std::string> argv;  // argv[0] is looked up on PATH (execvp), unless `program` is set
  std::string program;            // the file run instead of argv[0], without a PATH lookup
  // The child's environment: the parent's, without `unsetEnv` (a name ending in '*' removes every
  // name it begins), with `setEnv` added (replacing a variable of the same name).
  std::map<std::string, std::string> setEnv;
  std::vector<std::string> unsetEnv;
  ChildStream in, out, err;
  std::vector<std::pair<int, ChildStream>> extra;  // more descriptors (3, ...); a kPipe one is written by the child
  pid_t processGroup = kParentGroup;
  // Sent to the child when the parent thread dies (PR_SET_PDEATHSIG); 0: none. A child whose parent
  // is already gone when it would set it exits with 128 + the signal.
  int parentDeathSignal = 0;
  bool clearSignalMask = false;  // the child starts with no signal blocked, not with the parent's mask
  // A failed exec: unset, spawn() throws SubprocessError "cannot run ARGV0: REASON" (the child is
  // reaped first); set, the child writes PREFIX "cannot run ARGV0: REASON" and a newline to its
  // stderr and exits 127, as a shell does, and spawn() returns.
  std::optional<std::string> execFailurePrefix;
};

// Starting a child failed: "fork failed: REASON", "cannot create a pipe: REASON", "cannot open
// /dev/null: REASON", "its input does not fit a pipe", "cannot run ARGV0: REASON". Callers prefix
// what they were doing.
class SubprocessError : public Error {
 public:
  using Error::Error;
};

// How a child ended: waitpid's status.
struct ExitStatus {
  int raw = 0;
  bool exited() const;
  int code() const;  // the exit status when exited(), else -1
  bool signaled() const;
  int signal() const;  // the signal that killed it when signaled(), else 0
  bool ok() const { return exited() && code() == 0; }
  int shellCode() const;  // the status, or 128 + the signal, as a shell's $?
};

class Subprocess {
 public:
  // Starts options.argv as described above; throws SubprocessError (nothing is left running then).
  static Subprocess spawn(const SubprocessOptions& options);
  // Forks and runs `body` in the child, which then exits with what it returns (1 when it throws).
  // No exec: for a process without threads yet (the child has only the forking thread).
  static Subprocess fork(const std::function<int()>& body);

  Subprocess() = default;
  Subprocess(Subprocess&& other) noexcept;
  Subprocess& operator=(Subprocess&& other) noexcept;
  Subprocess(const Subprocess&) = delete;
  Subprocess& operator=(const Subprocess&) = delete;
  ~Subprocess();

  pid_t pid() const { return pid_; }
  // Started and not yet waited for (it may have exited: a zombie until waited for).
  bool running() const { return pid_ > 0 && !status_; }
  // How it ended, once a wait saw it.
  const std::optional<ExitStatus>& status() const { return status_; }

  // The parent's end of the pipe at the child's descriptor `childFd`; -1 when there is none.
  int fd(int childFd) const;
  // Hands that end to the caller, who closes it; -1 when there is none.
  int releaseFd(int childFd);
  void closeFd(int childFd);

  // Reaps it if it has exited; nullopt while it runs. Once reaped, returns the status again. Both
  // waits throw Error when waitpid cannot reap it (SIGCHLD ignored: the kernel reaped it).
  std::optional<ExitStatus> tryWait();
  // Waits until it exits or `deadline` passes (nullopt then: it still runs).
  std::optional<ExitStatus> waitUntil(IoClock::time_point deadline);
  ExitStatus wait();

  // `signo` to the process while it is not reaped (a no-op after).
  void signal(int signo) const;
  // `signo` to its process group (kNewGroup, or the group it joined): the child and what it
  // started there, even once the child itself is reaped. A no-op for a child in the parent's group.
  void signalGroup(int signo) const;

  // Appends what the child writes to `childFd` (a kPipe) to `out` until it closes the pipe
  // (kClosed), `limit` more bytes have come (kOk), or `deadline` passes (kTimeout); kError: errno.
  // What is already there is read even when the deadline has passed.
  IoStatus readOutput(std::string& out, IoClock::time_point deadline, size_t limit, int childFd = 1);
  // Appends what has come on `childFd`, at least one byte, waiting until `deadline`: kOk, kClosed
  // (end of file, nothing appended), kTimeout or kError.
  IoStatus readSome(std::string& out, IoClock::time_point deadline, int childFd = 1);

 private:
  void reset();
  [[noreturn]] void throwNotReapable() const;

  pid_t pid_ = -1;
  pid_t group_ = 0;  // the process group signalGroup reaches; 0: none of its own
  std::optional<ExitStatus> status_;
  std::map<int, int> fds_;  // the child's descriptor -> the parent's end of its pipe
};

// Runs argv to its end, standard input closed, its standard output and error read together (up to
// `limit` bytes; the pipe is closed after), in a process group of its own that dies with the
// caller's thread and is killed whole when `timeout` passes (`status` nullopt then). Throws
// SubprocessError when it cannot start.
struct CapturedRun {
  std::optional<ExitStatus> status;
  std::string output;
};
CapturedRun runCapturingOutput(const std::vector<std::string>& argv, std::chrono::seconds timeout, size_t limit);

// "SIGTERM" for SIGTERM; "unknown signal" for a number without a name.
std::string signalName(int signo);

}  // namespace cohort
