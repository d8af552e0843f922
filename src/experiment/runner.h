// Runs many training jobs (each one or more processes of the `cohort` binary, usually `cohort train`
// alone or under `cohort launch`) as separate jobs, a few at a time, resumably. `cohort compare` and
// `cohort sweep` are built on it. Torch-free.
//
// The contract:
//
// Files. Job ID lives in DIR/runs/ID/: `output.log` (the job's stdout and stderr), `metrics.jsonl`
// (written by the job itself: the caller puts that path in its command) and, once the job has
// ended, `status.json`: {"id", "status": "ok" | "failed", "exit_code", "error", "wall_s",
// "command"}. status.json is written to a temporary file and renamed, so it is whole or absent.
//
// Resuming. A job whose status.json exists and records the same command (every process's argv)
// has finished: it is not run again, and its record is returned as it was (a failed job stays
// failed: delete its folder to run it again). Any other job starts afresh: its folder is emptied
// first, so a job killed half-way never leaves half a metrics file behind.
//
// Processes. Every process of a job is forked with a clean signal mask, put into one process group
// per job, and gets SIGTERM when the runner dies (PR_SET_PDEATHSIG), so a SIGKILLed runner leaves
// no job behind (`cohort launch` forwards the SIGTERM to its ranks). Unless the caller's
// environment for the process sets it, OMP_NUM_THREADS and OPENBLAS_NUM_THREADS are
// max(1, cores / (parallel jobs x the job's `threadsShare`)).
//
// Ending. A job is ok when all its processes with `waitedFor` exit 0; the others (parameter-server
// shards run by hand) then get SIGTERM and, graceSeconds later, SIGKILL. The first process to fail
// fails the job: the rest of its group gets SIGTERM, then SIGKILL. (A process with `input` gets
// its standard input closed instead of the SIGTERM.) A job still running after
// `timeoutSeconds` fails the same way ("timed out after S s"). The recorded error is the first
// "cohort: error:" line of the log (without its "[rank i]" prefix), else the launcher's line, else
// the log's last line, else the exit status. SIGINT or SIGTERM sent to the runner ends every running
// job the same way, records nothing for them, and makes runJobs throw Interrupted.
#pragma once

#include <cohort/error.h>

#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace cohort::experiment {

struct ProcessSpec {
  std::vector<std::string> argv;  // argv[0] is looked up on PATH
  std::map<std::string, std::string> env;  // added to (and overriding) the runner's environment
  bool waitedFor = true;  // false: a server the job ends with SIGTERM once the others are done
  // When set, the process's standard input is a pipe that starts with this text and that the
  // runner keeps open until it ends the job, instead of /dev/null. Ending the job closes it
  // instead of sending SIGTERM: the process (a remote shell, experiment/remote.h) is expected to
  // end on that EOF; SIGKILL still follows graceSeconds later.
  std::optional<std::string> input;
};

struct JobSpec {
  std::string id;  // a folder name: letters, digits, '-', '_', '.'
  std::vector<ProcessSpec> processes;
  int threadsShare = 1;  // how many processes of this job compute at once (the cores are split)
  // What a finished run must have recorded to be kept instead of run again: its command
  // (commandOf) when empty. Set where the command holds what changes from one invocation to the
  // next (an emulated network's namespace names) or misses what makes the run (the link's rate).
  std::string identity;
};

// The job's processes as a shell would run them: environment and argv, shell-quoted, one process
// per line (an auth token is left out).
std::string commandOf(const JobSpec& job);

struct RunnerOptions {
  std::string dir;  // jobs live in dir/runs/ID
  int parallel = 1;  // jobs at once
  double timeoutSeconds = 3600;  // per job
  double graceSeconds = 10;  // from SIGTERM to SIGKILL
  int cores = 0;  // 0: the machine's
};

enum class JobStatus { kOk, kFailed };

struct JobRecord {
  std::string id;
  JobStatus status = JobStatus::kFailed;
  int exitCode = -1;
  std::string error;  // one line; empty when ok
  double wallSeconds = 0;
  std::string command;  // the processes' argv, shell-quoted, one process per line
  std::string identity;  // JobSpec::identity, or the command
  bool resumed = false;  // finished by an earlier runner: not run this time
  std::string metricsPath;
  std::string logPath;
};

// SIGINT or SIGTERM reached the runner; the running jobs were stopped. The command exits with
// 128 + signal(), as a shell reports a process that signal ended.
class Interrupted : public Error {
 public:
  Interrupted(const std::string& message, int signo) : Error(message), signo_(signo) {}
  int signal() const { return signo_; }

 private:
  int signo_;
};

// Called as each job ends (or is found finished), in the order they end.
using JobCallback = std::function<void(const JobRecord&, size_t finished, size_t total)>;

// Runs the jobs not finished yet (in the order given, `parallel` at a time) and returns every job's
// record in the order given. Throws InvalidArgument for a bad id, a duplicate id or a job without
// processes, IoError when dir cannot be written, Interrupted as above.
std::vector<JobRecord> runJobs(const std::vector<JobSpec>& jobs, const RunnerOptions& options,
                               const JobCallback& onEnd = {});

// dir/runs/id/metrics.jsonl: where a job's command should write its metrics.
std::string metricsPathOf(const std::string& dir, const std::string& id);
std::string jobDirOf(const std::string& dir, const std::string& id);

// A command line a shell would run as argv: words quoted where needed.
std::string shellQuote(const std::vector<std::string>& argv);

// The first "cohort: error:" line of a log (its "[rank i] " prefix removed), else the first line
// of `cohort launch`'s own, else the last non-empty line; empty for an empty log.
std::string errorFromLog(const std::string& logText);

}  // namespace cohort::experiment
