#include "experiment/runner.h"

#include "base/clock.h"
#include "base/files.h"
#include "base/subprocess.h"

#include <nlohmann/json.hpp>

#include <fcntl.h>
#include <signal.h>
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
  replaceFileWithText(jobDirOf(dir, r.id) + "/status.json", j.dump(2) + "\n");
}

struct Process {
  // With a ProcessSpec::input, the parent's end of its standard input stays open until the job ends.
  Subprocess process;
  bool waitedFor = true;
  bool exited() const { return process.status().has_value(); }
  ExitStatus status() const { return process.status().value_or(ExitStatus{}); }
};

struct Running {
  size_t index = 0;
  JobRecord record;
  std::vector<Process> processes;  // the first leads the job's process group
  bool hasInputs = false;  // some process has a ProcessSpec::input
  Clock::time_point start;
  bool ending = false;  // SIGTERM sent to the group
  Clock::time_point killAt;
  bool failed = false;
  int exitCode = 0;
  std::string error;  // set by the runner (timeout); otherwise read from the log
};

std::string statusText(const ExitStatus& status) {
  if (status.exited()) return "exited with status " + std::to_string(status.code());
  const char* abbrev = ::sigabbrev_np(status.signal());
  return std::string("killed by signal ") +
         (abbrev != nullptr ? std::string("SIG") + abbrev : std::to_string(status.signal()));
}

// `signo` to every process of the job (and what they started).
void signalGroup(const Running& r, int signo) {
  if (!r.processes.empty()) r.processes.front().process.signalGroup(signo);
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
      const pid_t group = r.processes.empty() ? kNewGroup : r.processes.front().process.pid();
      r.processes.push_back(spawn(spec, log, threads, group));
    }
    ::close(log);
    running_.push_back(std::move(r));
  }

  // The job's processes share one group (the first leads it) and its log; they die with the runner.
  static Process spawn(const ProcessSpec& spec, int log, int threads, pid_t group) {
    SubprocessOptions options{.argv = spec.argv,
                              .in = spec.input ? ChildStream::pipe(*spec.input) : ChildStream::null(),
                              .out = ChildStream::copyOf(log),
                              .err = ChildStream::copyOf(log),
                              .processGroup = group,
                              .parentDeathSignal = SIGTERM,
                              .clearSignalMask = true,
                              .execFailurePrefix = "cohort: error: "};
    for (const char* name : {"OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS"}) {
      if (std::getenv(name) == nullptr) options.setEnv[name] = std::to_string(threads);
    }
    for (const auto& [key, value] : spec.env) options.setEnv[key] = value;
    try {
      return Process{.process = Subprocess::spawn(options), .waitedFor = spec.waitedFor};
    } catch (const SubprocessError& e) {
      throw Error(std::string("cannot start a job: ") + e.what());
    }
  }

  void reap() {
    for (Running& r : running_) {
      for (Process& p : r.processes) {
        if (!p.exited() && p.process.tryWait()) closeInput(p);
      }
    }
  }

  static void closeInput(Process& p) { p.process.closeFd(STDIN_FILENO); }

  // Asks every process of the job to end: `signo` to its group, or, in a job with inputs, EOF to
  // the processes with one and `signo` to each of the others.
  static void signalJob(Running& r, int signo) {
    if (!r.hasInputs) {
      signalGroup(r, signo);
      return;
    }
    for (Process& p : r.processes) {
      if (p.exited()) continue;
      if (p.process.fd(STDIN_FILENO) >= 0) {
        closeInput(p);
      } else {
        p.process.signal(signo);
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
        if (!p.exited()) {
          anyLeft = true;
          if (p.waitedFor) workersDone = false;
          continue;
        }
        if (!p.status().ok() && !r.failed && !(r.ending && !p.waitedFor)) {
          r.failed = true;
          r.exitCode = p.status().shellCode();
          r.error = statusText(p.status());
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
      if (r.ending && now >= r.killAt) signalGroup(r, SIGKILL);
    }
    for (auto it = running_.begin(); it != running_.end();) {
      const bool allExited =
          std::all_of(it->processes.begin(), it->processes.end(), [](const Process& p) { return p.exited(); });
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
    // SIGTERM, whichever signal came: a job inherits an ignored SIGINT (a sweep started with & from
    // a script), and would sit out the grace period until the SIGKILL.
    for (Running& r : running_) signalJob(r, SIGTERM);
    const auto deadline = Clock::now() + std::chrono::duration<double>(options_.graceSeconds);
    while (Clock::now() < deadline) {
      reap();
      const bool allExited = std::all_of(running_.begin(), running_.end(), [](const Running& r) {
        return std::all_of(r.processes.begin(), r.processes.end(), [](const Process& p) { return p.exited(); });
      });
      if (allExited) break;
      timespec tick{0, long(std::chrono::nanoseconds(kTick).count())};
      sigset_t chld;
      sigemptyset(&chld);
      sigaddset(&chld, SIGCHLD);
      ::sigtimedwait(&chld, nullptr, &tick);
    }
    for (Running& r : running_) {
      signalGroup(r, SIGKILL);
      for (Process& p : r.processes) p.process.wait();
    }
    throw Interrupted(std::string("interrupted by ") + (signo == SIGINT ? "SIGINT" : "SIGTERM") +
                          ": finished jobs are kept; run the same command again to go on",
                      signo);
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
