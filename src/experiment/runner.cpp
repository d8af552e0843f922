#include "experiment/runner.h"

#include "base/clock.h"

#include <nlohmann/json.hpp>

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <set>
#include <sstream>
#include <thread>

extern char** environ;

namespace cohort::experiment {
namespace fs = std::filesystem;

namespace {

constexpr auto kTick = std::chrono::milliseconds(200);  // how often deadlines are looked at

std::string readText(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

void writeFileAtomically(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out << text;
    out.flush();
    COHORT_CHECK(out.good(), IoError, tmp, ": cannot write: ", std::strerror(errno));
  }
  const int fd = ::open(tmp.c_str(), O_RDONLY);
  if (fd >= 0) {
    ::fsync(fd);
    ::close(fd);
  }
  COHORT_CHECK(::rename(tmp.c_str(), path.c_str()) == 0, IoError, path, ": cannot write: ", std::strerror(errno));
}

bool validId(const std::string& id) {
  if (id.empty() || id == "." || id == "..") return false;
  return std::all_of(id.begin(), id.end(), [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_' || c == '.';
  });
}

std::string identityOf(const JobSpec& job, const std::string& command) {
  return job.identity.empty() ? command : job.identity;
}

std::optional<JobRecord> finishedRecord(const std::string& dir, const JobSpec& job, const std::string& command) {
  const std::string path = jobDirOf(dir, job.id) + "/status.json";
  if (!fs::exists(path)) return std::nullopt;
  try {
    const auto j = nlohmann::json::parse(readText(path));
    const std::string recorded = j.contains("identity") ? j.at("identity").get<std::string>() : j.at("command").get<std::string>();
    if (recorded != identityOf(job, command)) return std::nullopt;
    JobRecord r;
    r.id = job.id;
    r.status = j.at("status").get<std::string>() == "ok" ? JobStatus::kOk : JobStatus::kFailed;
    r.exitCode = j.at("exit_code").get<int>();
    r.error = j.at("error").get<std::string>();
    r.wallSeconds = j.at("wall_s").get<double>();
    r.command = j.at("command").get<std::string>();  // as it ran
    r.identity = recorded;
    r.resumed = true;
    r.metricsPath = metricsPathOf(dir, job.id);
    r.logPath = jobDirOf(dir, job.id) + "/output.log";
    return r;
  } catch (const std::exception&) {
    return std::nullopt;  // unreadable: run the job again
  }
}

void writeStatus(const std::string& dir, const JobRecord& r) {
  nlohmann::ordered_json j;
  j["id"] = r.id;
  j["status"] = r.status == JobStatus::kOk ? "ok" : "failed";
  j["exit_code"] = r.exitCode;
  j["error"] = r.error;
  j["wall_s"] = r.wallSeconds;
  j["command"] = r.command;
  if (r.identity != r.command) j["identity"] = r.identity;
  writeFileAtomically(jobDirOf(dir, r.id) + "/status.json", j.dump(2) + "\n");
}

struct Process {
  pid_t pid = -1;
  int input = -1;  // the write end of its standard input (ProcessSpec::input), open until the job ends
  bool waitedFor = true;
  bool exited = false;
  int status = 0;
};

struct Running {
  size_t index = 0;
  JobRecord record;
  std::vector<Process> processes;
  pid_t group = -1;
  bool hasInputs = false;  // some process has a ProcessSpec::input
  Clock::time_point start;
  bool ending = false;  // SIGTERM sent to the group
  Clock::time_point killAt;
  bool failed = false;
  int exitCode = 0;
  std::string error;  // set by the runner (timeout); otherwise read from the log
};

int exitCodeOf(int status) { return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status); }

std::string statusText(int status) {
  if (WIFEXITED(status)) return "exited with status " + std::to_string(WEXITSTATUS(status));
  const char* abbrev = ::sigabbrev_np(WTERMSIG(status));
  return std::string("killed by signal ") + (abbrev != nullptr ? std::string("SIG") + abbrev : std::to_string(WTERMSIG(status)));
}

// Blocks SIGCHLD, SIGINT and SIGTERM for the runner's lifetime (they are taken with sigtimedwait)
// and restores the earlier mask after.
class BlockedSignals {
 public:
  BlockedSignals() {
    sigemptyset(&set_);
    sigaddset(&set_, SIGCHLD);
    sigaddset(&set_, SIGINT);
    sigaddset(&set_, SIGTERM);
    ::pthread_sigmask(SIG_BLOCK, &set_, &old_);
  }
  ~BlockedSignals() {
    // Consume what is pending for the signals this runner took, then restore.
    timespec zero{0, 0};
    sigset_t chld;
    sigemptyset(&chld);
    sigaddset(&chld, SIGCHLD);
    while (::sigtimedwait(&chld, nullptr, &zero) > 0) {
    }
    ::pthread_sigmask(SIG_SETMASK, &old_, nullptr);
  }
  const sigset_t& set() const { return set_; }

 private:
  sigset_t set_;
  sigset_t old_;
};

class Runner {
 public:
  Runner(const std::vector<JobSpec>& jobs, const RunnerOptions& options, const JobCallback& onEnd)
      : jobs_(jobs), options_(options), onEnd_(onEnd), records_(jobs.size()) {
    cores_ = options.cores > 0 ? options.cores : int(std::max(1u, std::thread::hardware_concurrency()));
  }

  std::vector<JobRecord> run() {
    std::vector<size_t> pending;
    for (size_t i = 0; i < jobs_.size(); ++i) {
      const std::string command = commandOf(jobs_[i]);
      if (auto done = finishedRecord(options_.dir, jobs_[i], command)) {
        records_[i] = *done;
        ++finished_;
        if (onEnd_) onEnd_(records_[i], finished_, jobs_.size());
      } else {
        pending.push_back(i);
      }
    }
    std::reverse(pending.begin(), pending.end());
    while (!pending.empty() || !running_.empty()) {
      while (int(running_.size()) < std::max(1, options_.parallel) && !pending.empty()) {
        start(pending.back());
        pending.pop_back();
      }
      timespec tick{0, long(std::chrono::nanoseconds(kTick).count())};
      const int signo = ::sigtimedwait(&signals_.set(), nullptr, &tick);
      if (signo == SIGINT || signo == SIGTERM) interrupt(signo);
      reap();
      advance();
    }
    return records_;
  }

 private:
  void start(size_t index) {
    const JobSpec& job = jobs_[index];
    Running r;
    r.index = index;
    r.record.id = job.id;
    r.record.command = commandOf(job);
    r.record.identity = identityOf(job, r.record.command);
    r.record.metricsPath = metricsPathOf(options_.dir, job.id);
    const std::string dir = jobDirOf(options_.dir, job.id);
    r.record.logPath = dir + "/output.log";
    std::error_code ec;
    fs::remove_all(dir, ec);
    fs::create_directories(dir, ec);
    COHORT_CHECK(!ec, IoError, dir, ": cannot create the job's folder: ", ec.message());
    const int log = ::open(r.record.logPath.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_APPEND | O_CLOEXEC, 0644);
    COHORT_CHECK(log >= 0, IoError, r.record.logPath, ": cannot create: ", std::strerror(errno));
    const int threads = std::max(1, cores_ / (std::max(1, options_.parallel) * std::max(1, job.threadsShare)));
    r.start = Clock::now();
    for (const ProcessSpec& spec : job.processes) {
      r.hasInputs = r.hasInputs || spec.input.has_value();
      r.processes.push_back(spawn(spec, log, threads, r.group));
      if (r.group < 0) r.group = r.processes.back().pid;
    }
    ::close(log);
    running_.push_back(std::move(r));
  }

  Process spawn(const ProcessSpec& spec, int log, int threads, pid_t group) {
    // Everything the child needs is built before fork: after it, only async-signal-safe calls.
    std::map<std::string, std::string> env;
    for (char** e = environ; *e != nullptr; ++e) {
      const std::string entry(*e);
      const size_t eq = entry.find('=');
      if (eq != std::string::npos) env[entry.substr(0, eq)] = entry.substr(eq + 1);
    }
    for (const char* name : {"OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS"}) {
      if (!env.count(name)) env[name] = std::to_string(threads);
    }
    for (const auto& [key, value] : spec.env) env[key] = value;
    std::vector<std::string> envStrings;
    for (const auto& [key, value] : env) envStrings.push_back(key + "=" + value);
    std::vector<char*> envp, argv;
    for (auto& s : envStrings) envp.push_back(s.data());
    envp.push_back(nullptr);
    std::vector<std::string> args = spec.argv;
    for (auto& s : args) argv.push_back(s.data());
    argv.push_back(nullptr);
    const pid_t parent = ::getpid();
    int input[2] = {-1, -1};
    if (spec.input) {
      COHORT_CHECK(::pipe2(input, O_CLOEXEC) == 0, Error, "cannot start a job: pipe: ", std::strerror(errno));
      // Written before the fork, into an empty pipe: a short text never blocks nor meets SIGPIPE.
      const ssize_t n = ::write(input[1], spec.input->data(), spec.input->size());
      COHORT_CHECK(n == ssize_t(spec.input->size()), Error, "cannot start a job: its input does not fit a pipe");
    }

    const pid_t pid = ::fork();
    COHORT_CHECK(pid >= 0, Error, "cannot start a job: fork failed: ", std::strerror(errno));
    if (pid == 0) {
      ::setpgid(0, group < 0 ? 0 : group);
      ::prctl(PR_SET_PDEATHSIG, SIGTERM);
      if (::getppid() != parent) ::_exit(127);  // the runner died before prctl
      sigset_t none;
      sigemptyset(&none);
      ::sigprocmask(SIG_SETMASK, &none, nullptr);
      ::dup2(input[0] >= 0 ? input[0] : ::open("/dev/null", O_RDONLY), STDIN_FILENO);
      ::dup2(log, STDOUT_FILENO);
      ::dup2(log, STDERR_FILENO);
      ::execvpe(argv[0], argv.data(), envp.data());
      const char* why = std::strerror(errno);
      const std::string message = "cohort: error: cannot run " + spec.argv[0] + ": " + why + "\n";
      [[maybe_unused]] ssize_t n = ::write(STDERR_FILENO, message.data(), message.size());
      ::_exit(127);
    }
    ::setpgid(pid, group < 0 ? pid : group);  // also here, so that a kill right after cannot miss it
    if (input[0] >= 0) ::close(input[0]);
    return Process{.pid = pid, .input = input[1], .waitedFor = spec.waitedFor};
  }

  void reap() {
    for (;;) {
      int status = 0;
      const pid_t pid = ::waitpid(-1, &status, WNOHANG);
      if (pid <= 0) return;
      for (Running& r : running_) {
        for (Process& p : r.processes) {
          if (p.pid == pid) {
            p.exited = true;
            p.status = status;
            closeInput(p);
          }
        }
      }
    }
  }

  static void closeInput(Process& p) {
    if (p.input >= 0) ::close(p.input);
    p.input = -1;
  }

  // Asks every process of the job to end: `signo` to its group, or, in a job with inputs, EOF to
  // the processes with one and `signo` to each of the others.
  static void signalJob(Running& r, int signo) {
    if (!r.hasInputs) {
      ::kill(-r.group, signo);
      return;
    }
    for (Process& p : r.processes) {
      if (p.exited) continue;
      if (p.input >= 0) {
        closeInput(p);
      } else {
        ::kill(p.pid, signo);
      }
    }
  }

  void endGroup(Running& r) {
    if (r.ending) return;
    r.ending = true;
    signalJob(r, SIGTERM);
    r.killAt = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(options_.graceSeconds));
  }

  void advance() {
    const auto now = Clock::now();
    for (Running& r : running_) {
      bool workersDone = true;
      bool anyLeft = false;
      for (const Process& p : r.processes) {
        if (!p.exited) {
          anyLeft = true;
          if (p.waitedFor) workersDone = false;
          continue;
        }
        const bool ok = WIFEXITED(p.status) && WEXITSTATUS(p.status) == 0;
        if (!ok && !r.failed && !(r.ending && !p.waitedFor)) {
          r.failed = true;
          r.exitCode = exitCodeOf(p.status);
          r.error = statusText(p.status);
          endGroup(r);
        }
      }
      if (workersDone && anyLeft && !r.failed) endGroup(r);  // servers left: stop them
      if (!r.failed && now - r.start > std::chrono::duration<double>(options_.timeoutSeconds)) {
        r.failed = true;
        r.exitCode = 124;
        r.error = "timed out after " + std::to_string(int(options_.timeoutSeconds)) + " s (--run-timeout)";
        r.record.error = r.error;
        endGroup(r);
      }
      if (r.ending && now >= r.killAt) ::kill(-r.group, SIGKILL);
    }
    for (auto it = running_.begin(); it != running_.end();) {
      const bool allExited = std::all_of(it->processes.begin(), it->processes.end(), [](const Process& p) { return p.exited; });
      if (!allExited) {
        ++it;
        continue;
      }
      finish(*it);
      it = running_.erase(it);
    }
  }

  void finish(Running& r) {
    JobRecord& rec = r.record;
    rec.wallSeconds = secondsSince(r.start);
    rec.status = r.failed ? JobStatus::kFailed : JobStatus::kOk;
    rec.exitCode = r.failed ? r.exitCode : 0;
    if (r.failed && rec.error.empty()) {
      rec.error = errorFromLog(readText(rec.logPath));
      if (rec.error.empty()) rec.error = r.error;
    }
    writeStatus(options_.dir, rec);
    records_[r.index] = rec;
    ++finished_;
    if (onEnd_) onEnd_(rec, finished_, jobs_.size());
  }

  [[noreturn]] void interrupt(int signo) {
    for (Running& r : running_) signalJob(r, signo);
    const auto deadline = Clock::now() + std::chrono::duration<double>(options_.graceSeconds);
    while (Clock::now() < deadline) {
      reap();
      const bool allExited = std::all_of(running_.begin(), running_.end(), [](const Running& r) {
        return std::all_of(r.processes.begin(), r.processes.end(), [](const Process& p) { return p.exited; });
      });
      if (allExited) break;
      timespec tick{0, long(std::chrono::nanoseconds(kTick).count())};
      sigset_t chld;
      sigemptyset(&chld);
      sigaddset(&chld, SIGCHLD);
      ::sigtimedwait(&chld, nullptr, &tick);
    }
    for (Running& r : running_) {
      ::kill(-r.group, SIGKILL);
      for (Process& p : r.processes) {
        if (!p.exited) ::waitpid(p.pid, &p.status, 0);
      }
    }
    throw Interrupted(std::string("interrupted by ") + (signo == SIGINT ? "SIGINT" : "SIGTERM") +
                      ": finished jobs are kept; run the same command again to go on");
  }

  const std::vector<JobSpec>& jobs_;
  const RunnerOptions& options_;
  const JobCallback& onEnd_;
  std::vector<JobRecord> records_;
  std::vector<Running> running_;
  size_t finished_ = 0;
  int cores_ = 1;
  BlockedSignals signals_;
};

}  // namespace

std::string commandOf(const JobSpec& job) {
  std::string out;
  for (const ProcessSpec& p : job.processes) {
    if (!out.empty()) out += "\n";
    std::vector<std::string> words;
    for (const auto& [key, value] : p.env) {
      if (key != "COHORT_AUTH_TOKEN") words.push_back(key + "=" + value);  // a secret is never written down
    }
    words.insert(words.end(), p.argv.begin(), p.argv.end());
    out += shellQuote(words);
  }
  return out;
}

std::string jobDirOf(const std::string& dir, const std::string& id) { return dir + "/runs/" + id; }

std::string metricsPathOf(const std::string& dir, const std::string& id) { return jobDirOf(dir, id) + "/metrics.jsonl"; }

std::string shellQuote(const std::vector<std::string>& argv) {
  std::string out;
  for (const std::string& word : argv) {
    if (!out.empty()) out += ' ';
    const bool plain = !word.empty() && std::all_of(word.begin(), word.end(), [](char c) {
      return std::isalnum(static_cast<unsigned char>(c)) || std::strchr("-_./:=,+@%", c) != nullptr;
    });
    if (plain) {
      out += word;
      continue;
    }
    out += '\'';
    for (char c : word) {
      if (c == '\'') {
        out += "'\\''";
      } else {
        out += c;
      }
    }
    out += '\'';
  }
  return out;
}

std::string errorFromLog(const std::string& logText) {
  std::vector<std::string> lines;
  std::istringstream in(logText);
  for (std::string line; std::getline(in, line);) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (!line.empty()) lines.push_back(line);
  }
  auto withoutPrefix = [](std::string line) {
    if (line.rfind("[", 0) == 0) {
      const size_t close = line.find("] ");
      if (close != std::string::npos) line = line.substr(close + 2);
    }
    return line;
  };
  for (const std::string& line : lines) {
    const std::string text = withoutPrefix(line);
    if (text.rfind("cohort: error: ", 0) == 0) return text.substr(15);
  }
  for (const std::string& line : lines) {
    if (line.rfind("cohort launch: ", 0) == 0) return line;
  }
  return lines.empty() ? "" : withoutPrefix(lines.back());
}

std::vector<JobRecord> runJobs(const std::vector<JobSpec>& jobs, const RunnerOptions& options, const JobCallback& onEnd) {
  std::set<std::string> ids;
  for (const JobSpec& job : jobs) {
    COHORT_CHECK(validId(job.id), InvalidArgument, "'", job.id,
                 "' cannot name a run: use letters, digits, '-', '_' and '.'");
    COHORT_CHECK(ids.insert(job.id).second, InvalidArgument, "two runs are named '", job.id, "'");
    COHORT_CHECK(!job.processes.empty(), InvalidArgument, "run '", job.id, "' has no command");
  }
  std::error_code ec;
  fs::create_directories(options.dir + "/runs", ec);
  COHORT_CHECK(!ec, IoError, options.dir, ": cannot create the output folder: ", ec.message());
  Runner runner(jobs, options, onEnd);
  return runner.run();
}

}  // namespace cohort::experiment
