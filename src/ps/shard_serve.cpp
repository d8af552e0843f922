// serveShard: one shard served until its job is done. What belongs to the process around it
// (signals, the allocator, the test hook that kills it at a version, its lines on stdout) is the
// command line's: src/cli/shard_process.cpp.
#include "base/launcher_channel.h"
#include "ps/service.h"

#include <cohort/env.h>

#include <chrono>
#include <string>

namespace cohort::ps {

namespace {

// How often serveShard looks at the shard and at stopRequested.
constexpr auto kPoll = std::chrono::milliseconds(250);

}  // namespace

ServeOutcome serveShard(const ServerOptions& options) {
  Env& env = envOrStandard(options.shard.env);
  ShardServer server(options);
  const std::shared_ptr<Shard> shard = server.shard();
  launcher::tellPort(server.port());  // port 0: cohort launch starts the workers once it knows this
  if (options.onListening) options.onListening(server.port());
  // Where the shard's own messages go: ShardOptions::log when given, else the Env.
  auto warn = [&](const std::string& line) {
    if (options.shard.log) {
      options.shard.log(line);
    } else {
      env.log(LogLevel::kWarning, line);
    }
  };
  if (options.authToken.empty()) {
    warn("no auth token: this shard accepts requests from anyone who can reach it");
  } else if (!server.checksTokenBeforeBody()) {
    warn("plaintext on " + options.address +
         ": calls prove the secret without sending it, but their bodies travel unprotected and are read before "
         "the proof is checked; serve TLS (--tls-cert/--tls-key) off loopback");
  }
  for (;;) {
    server.trimFreedMemory();
    if (const auto failure = shard->waitFinished(kPoll)) {
      server.shutdown();
      return {ServeOutcome::End::kFailed, *failure};
    }
    if (shard->finished()) {
      server.shutdown();
      if (const auto error = shard->finalCheckpointError()) {
        // The run is over (every worker is done) but cannot be resumed: the job fails, naming the
        // disk, and cohort launch does not restart it onto that disk again.
        launcher::tellFinished();
        launcher::tellError(*error);
        return {ServeOutcome::End::kFailed, *error};
      }
      return {ServeOutcome::End::kFinished, ""};
    }
    if (options.stopRequested) {
      if (std::string reason = options.stopRequested(); !reason.empty()) {
        // Checkpoint before shutting down: a held push can keep shutdown busy, and a second signal
        // (or SIGKILL) may follow.
        shard->checkpoint();
        server.shutdown();
        return {ServeOutcome::End::kStopped, reason};
      }
    }
  }
}

}  // namespace cohort::ps
