// The process around one shard (`cohort ps`, and the ps tasks of `cohort train`): what a library
// must not do to its caller's process. ps::serveShard serves; this file adds the signals that stop
// it, the allocator setting, the stdout line the launcher and `cohort simulate` read, and the test
// hook that kills the process at a version.
#include <cohort/env.h>

#include "cli/commands.h"
#include "ps/client.h"
#include "ps/service.h"

#include <sys/resource.h>

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <string>

namespace cohort::cli {

namespace {

// The signal the shard was asked to stop by; 0 while none.
volatile std::sig_atomic_t stopSignal = 0;

void onStopSignal(int signal) { stopSignal = signal; }

// Installs onStopSignal for SIGTERM and SIGINT while alive; puts the previous handlers back after.
class StopSignals {
 public:
  StopSignals() {
    stopSignal = 0;
    struct sigaction action {};
    action.sa_handler = onStopSignal;
    sigemptyset(&action.sa_mask);
    sigaction(SIGTERM, &action, &oldTerm_);
    sigaction(SIGINT, &action, &oldInt_);
  }
  ~StopSignals() {
    sigaction(SIGTERM, &oldTerm_, nullptr);
    sigaction(SIGINT, &oldInt_, nullptr);
  }
  StopSignals(const StopSignals&) = delete;
  StopSignals& operator=(const StopSignals&) = delete;

 private:
  struct sigaction oldTerm_ {};
  struct sigaction oldInt_ {};
};

// "0.0.0.0:0" with port 4711: "0.0.0.0:4711".
std::string withPort(const std::string& address, int port) {
  const size_t colon = address.rfind(':');
  return (colon == std::string::npos ? address : address.substr(0, colon)) + ":" + std::to_string(port);
}

// The shard's Env with the test hook: COHORT_TEST_KILL_SHARD_AT=V makes the process SIGKILL
// itself when its shard reaches version V (the fault point "ps.shard.version"), in its first run
// only (COHORT_RESTART_COUNT unset or 0): a shard dying at a known point.
class KillAtVersionEnv final : public Env {
 public:
  explicit KillAtVersionEnv(Env* inner) : inner_(envOrStandard(inner)), killAt_(killAtFromEnvironment()) {}

  void log(LogLevel level, const std::string& line) override { inner_.log(level, line); }
  std::chrono::steady_clock::time_point now() override { return inner_.now(); }
  void fault(const char* point, int64_t value) override {
    if (killAt_ != 0 && value == killAt_ && std::string(point) == "ps.shard.version") std::raise(SIGKILL);
    inner_.fault(point, value);
  }

 private:
  static int64_t killAtFromEnvironment() {
    const char* at = std::getenv("COHORT_TEST_KILL_SHARD_AT");
    const char* restarts = std::getenv("COHORT_RESTART_COUNT");
    if (!at || (restarts && std::string(restarts) != "0")) return 0;
    return int64_t(std::strtoull(at, nullptr, 10));
  }

  Env& inner_;
  const int64_t killAt_;
};

// A shard keeps a connection per worker, up to half its open-file limit (ps/service_connections.h):
// it takes the hard limit, as servers do, rather than a login shell's soft 1024 (512 workers).
void raiseOpenFileLimit() {
  rlimit files{};
  if (::getrlimit(RLIMIT_NOFILE, &files) != 0 || files.rlim_cur >= files.rlim_max) return;
  files.rlim_cur = files.rlim_max;
  ::setrlimit(RLIMIT_NOFILE, &files);  // refused (above fs.nr_open): the shard keeps what it has, and says so at Init
}

}  // namespace

int runShardProcess(ps::ServerOptions options) {
  raiseOpenFileLimit();
  ps::keepFreedMemory();
  ps::allocateFromOneHeap();
  StopSignals signals;
  KillAtVersionEnv faults(options.shard.env);
  options.shard.env = &faults;
  const std::string address = options.address;
  options.onListening = [address, then = std::move(options.onListening)](int port) {
    std::printf("cohort ps: listening on %s\n", withPort(address, port).c_str());
    std::fflush(stdout);
    if (then) then(port);
  };
  const bool checkpoints = !options.shard.checkpointDir.empty();
  options.stopRequested = [checkpoints]() -> std::string {
    const int signal = stopSignal;
    if (signal == 0) return "";
    const std::string name = signal == SIGINT ? "SIGINT" : "SIGTERM";
    // Said before the checkpoint is written: a second signal (or SIGKILL) may follow.
    std::fprintf(stderr, "cohort ps: %s: %s, stopping\n", name.c_str(),
                 checkpoints ? "writing a checkpoint" : "no --checkpoint-dir, nothing saved");
    return name;
  };
  const ps::ServeOutcome outcome = ps::serveShard(options);
  if (outcome.end == ps::ServeOutcome::End::kFailed) {
    std::fprintf(stderr, "cohort ps: error: %s\n", outcome.message.c_str());
  }
  return outcome.exitStatus();
}

}  // namespace cohort::cli
