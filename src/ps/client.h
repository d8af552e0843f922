// A shard as a worker sees it, behind one interface with two transports: gRPC (the real one) and
// an in-process fake that calls a Shard directly, through a serialize/parse round trip so that it
// checks what the wire would.
#pragma once

#include "ps/status.h"
#include "ps.pb.h"

#include <functional>
#include <memory>
#include <string>

namespace cohort::ps {

class Shard;

// HTTP/2 settings of both ends: the largest frame HTTP/2 allows, and a 64 MB stream window.
constexpr int kHttp2MaxFrame = (1 << 24) - 1;
constexpr int kHttp2Window = 64 << 20;

class ShardClient {
 public:
  virtual ~ShardClient() = default;
  virtual Status init(const wire::InitRequest& request, wire::InitReply* reply) = 0;
  virtual Status pull(const wire::PullRequest& request, wire::PullReply* reply) = 0;
  virtual Status push(const wire::PushRequest& request, wire::PushReply* reply) = 0;
  virtual Status done(const wire::DoneRequest& request, wire::DoneReply* reply) = 0;
  virtual Status stats(const wire::StatsRequest& request, wire::StatsReply* reply) = 0;
  virtual std::string address() const = 0;
};

struct ClientOptions {
  std::string authToken;      // every call proves it (ps/call_auth.h), never sends it; empty: none
  std::string tlsCaFile;      // PEM roots that sign the servers' certificates; empty: plaintext
  double timeoutSeconds = 60; // how long an unreachable shard is retried; a call's deadline is 2x + 5 s
  bool quiet = false;         // no line on stderr when a call starts retrying
  // Called (from the calling thread) each time a call fails with UNAVAILABLE and starts
  // retrying; tests wait on it instead of sleeping.
  std::function<void()> onRetry;
};

// Pushes and pulls allocate and free buffers of tens of MB every step; glibc serves each from a
// fresh mmap and unmaps it on free, so every byte costs a page fault, twice a step. This makes
// freed memory stay in the process's heap for reuse instead. Called by shards and ps workers.
void keepFreedMemory();

std::unique_ptr<ShardClient> makeFakeClient(std::shared_ptr<Shard> shard, std::string name = "fake");

// A client of the shard at host:port. Calls that fail with UNAVAILABLE (the shard is down or
// restarting, or not initialized yet) are retried with exponential back-off (50 ms doubling to
// 2 s) until timeoutSeconds have passed since the first attempt. Throws InvalidArgument when a
// TLS file cannot be read.
std::unique_ptr<ShardClient> makeGrpcClient(const std::string& address, const ClientOptions& options);

}  // namespace cohort::ps
