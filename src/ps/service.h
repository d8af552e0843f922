// The gRPC face of a Shard: `cohort ps`, and the parameter-server tasks of a `cohort launch --ps`
// or TF_CONFIG job.
#pragma once

#include "ps/shard.h"

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

namespace cohort::ps {

struct ServerOptions {
  std::string address = "127.0.0.1:0";  // host:port to listen on; port 0 picks a free one
  std::string authToken;    // every call must prove it (ps/call_auth.h); required off loopback
  std::string tlsCertFile;  // with tlsKeyFile: serve TLS instead of plaintext
  std::string tlsKeyFile;
  ShardOptions shard;
  // serveShard: called with the port it listens on (the one it chose, for port 0) once it does.
  std::function<void(int port)> onListening;
  // serveShard: asked every 250 ms; a reason ("SIGTERM") ends the serving, with a checkpoint first.
  std::function<std::string()> stopRequested;
  // The most connections the shard keeps open (ShardServer::connections); 0: half the process's
  // open-file limit (RLIMIT_NOFILE's soft limit, `ulimit -n`). Testing sets fewer.
  int maxConnections = 0;
};

// How serveShard ended.
struct ServeOutcome {
  enum class End { kFinished, kFailed, kStopped };
  End end = End::kFinished;
  std::string message;  // kFailed: what failed; kStopped: the reason stopRequested gave
  int exitStatus() const { return end == End::kFailed ? 1 : 0; }
};

// The connections a ShardServer holds (see ShardServer::connections).
struct ConnectionCounts {
  int open = 0;         // accepted and not closed since
  int unproven = 0;     // of those, without a call that carried a good proof yet (at most 64)
  int64_t evicted = 0;  // unproven connections closed to make room for a newcomer
  int64_t dropped = 0;  // newcomers closed at once: as many open as the shard keeps
};

class ShardServer {
 public:
  // Starts listening; throws Error when the address cannot be bound, InvalidArgument when a TLS
  // file cannot be read or only one of the two is given.
  explicit ShardServer(ServerOptions options);
  ~ShardServer();
  ShardServer(const ShardServer&) = delete;
  ShardServer& operator=(const ShardServer&) = delete;

  int port() const;
  std::shared_ptr<Shard> shard() const;
  void shutdown();
  // True when the token is checked on a call's metadata before gRPC reads its body: with TLS, or
  // plaintext on a loopback address (gRPC's local credentials). False for plaintext elsewhere.
  bool checksTokenBeforeBody() const;
  // The most bytes a request other than an Init may carry: 2.25 GiB until the chief's Init, then
  // twice the shard's values as float32 and 1 MB (an Init may always carry 2.25 GiB: a fresh one
  // replaces the layout). A request over its cap is refused with RESOURCE_EXHAUSTED naming both
  // sizes, and nothing else of the job is disturbed: before its body is read where the shard
  // checks metadata first (TLS, loopback), from the size every client declares; else once gRPC
  // has read it.
  uint64_t requestCapBytes() const;
  // What gRPC may hold for requests being read (its resource quota): half the machine's memory
  // (or its cgroup's limit), at least 2.25 GiB. A backstop, not a cap: past it gRPC cancels calls
  // of every connection.
  size_t requestQuotaBytes() const;
  // The shard accepts connections itself and hands them to gRPC: at most 64 that have not carried
  // a call with a good proof (with no secret: any call) at a time, a newcomer evicting the oldest,
  // as the store and the gossip peers hold theirs; at most maxConnections() in all. Each worker
  // holds one, so an Init for more workers than maxConnections() - 64 is refused
  // (FAILED_PRECONDITION), naming the limit and how to raise it.
  ConnectionCounts connections() const;
  // ServerOptions::maxConnections, or half the open-file limit when the server started.
  int maxConnections() const;
  // Testing: cuts every connection open now (shutdown), as a network failure would; its calls in
  // flight end on both sides, and the clients retry on new connections.
  void cutConnectionsForTesting();
  // Gives the heap pages a refused large request took back to the system (malloc_trim), if a
  // request was refused since the last time. serveShard calls it every 250 ms.
  void trimFreedMemory();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// What a ShardServer gives gRPC for requests being read on this machine (requestQuotaBytes): for
// a server that must be set up as a shard's is (bench/ps_bandwidth.cpp's bare gRPC).
size_t requestQuotaBytesForMachine();

// Serves one shard until every worker is done (kFinished), the shard fails (kFailed), or
// stopRequested gives a reason (a checkpoint, then kStopped). Every worker done but the final
// checkpoint not written (a full disk) is kFailed too, told to cohort launch as "finished" with the
// error, so that it does not restart the shard onto that disk. Tells cohort launch the port, warns
// through the shard's Env when the calls are open (no secret, or plaintext off loopback). Nothing
// process-wide: no signal handlers, no allocator settings, no output of its own.
ServeOutcome serveShard(const ServerOptions& options);

}  // namespace cohort::ps
