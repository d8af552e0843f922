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
  // runShardServer: called with the port it listens on (the one it chose, for port 0) once it does.
  std::function<void(int port)> onListening;
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
  // as the store and the gossip peers hold theirs; at most half the process's descriptors (up to
  // 1024) in all.
  ConnectionCounts connections() const;
  // Gives the heap pages a refused large request took back to the system (malloc_trim), if a
  // request was refused since the last time. runShardServer calls it every 250 ms.
  void trimFreedMemory();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// `cohort ps`: serves until every worker is done (0) or the shard fails (1); every worker done but
// the final checkpoint not written (a full disk) is a failure too (1, "finished" and the error told
// to cohort launch, which then does not restart it); SIGTERM or SIGINT write a checkpoint and end
// it (0). Prints "cohort ps: listening on HOST:PORT" once ready.
int runShardServer(const ServerOptions& options);

}  // namespace cohort::ps
