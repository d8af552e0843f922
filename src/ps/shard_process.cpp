// runShardServer: the process around one shard (`cohort ps`, and the ps tasks of `cohort train`):
// serve until the workers are done, stop on SIGTERM or SIGINT with a checkpoint, and the test
// hook that kills the process at a version. Process-wide concerns, kept apart from the shard and
// its gRPC service; they belong to the command line, and move there once every caller of
// runShardServer is in it (cohort train's ps tasks reach it through serveParameterServerShard).
#include "base/launcher_channel.h"
#include "ps/client.h"
#include "ps/service.h"

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <string>

namespace cohort::ps {

namespace {

// How often runShardServer looks for a signal.
constexpr auto kPoll = std::chrono::milliseconds(250);

// The signal runShardServer was asked to stop by; 0 while none.
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

}  // namespace

int runShardServer(const ServerOptions& options) {
  keepFreedMemory();
  StopSignals signals;
  KillAtVersionEnv faults(options.shard.env);
  ServerOptions withFaults = options;
  withFaults.shard.env = &faults;
  ShardServer server(withFaults);
  const std::shared_ptr<Shard> shard = server.shard();
  std::printf("cohort ps: listening on %s\n", withPort(options.address, server.port()).c_str());
  std::fflush(stdout);
  launcher::tellPort(server.port());  // port 0: cohort launch starts the workers once it knows this
  if (options.onListening) options.onListening(server.port());
  if (!options.authToken.empty() && !server.checksTokenBeforeBody()) {
    std::fprintf(stderr,
                 "cohort ps: warning: plaintext on %s: calls prove the secret without sending it, but their bodies "
                 "travel unprotected and are read before the proof is checked; serve TLS (--tls-cert/--tls-key) off "
                 "loopback\n",
                 options.address.c_str());
  }
  for (;;) {
    server.trimFreedMemory();
    if (const auto failure = shard->waitFinished(kPoll)) {
      std::fprintf(stderr, "cohort ps: error: %s\n", failure->c_str());
      server.shutdown();
      return 1;
    }
    if (shard->finished()) {
      server.shutdown();
      if (const auto error = shard->finalCheckpointError()) {
        // The run is over (every worker is done) but cannot be resumed: the job fails, naming the
        // disk, and cohort launch does not restart it onto that disk again.
        std::fprintf(stderr, "cohort ps: error: %s\n", error->c_str());
        launcher::tellFinished();
        launcher::tellError(*error);
        return 1;
      }
      return 0;
    }
    if (const int signal = stopSignal; signal != 0) {
      // Checkpoint before shutting down: a held push can keep shutdown busy, and a second signal
      // (or SIGKILL) may follow.
      std::fprintf(stderr, "cohort ps: %s: %s, stopping\n", signal == SIGINT ? "SIGINT" : "SIGTERM",
                   options.shard.checkpointDir.empty() ? "no --checkpoint-dir, nothing saved" : "writing a checkpoint");
      shard->checkpoint();
      server.shutdown();
      return 0;
    }
  }
}

}  // namespace cohort::ps
