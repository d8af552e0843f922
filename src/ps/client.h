// A shard as a worker sees it, behind one interface with two transports: gRPC (the real one) and
// an in-process fake that calls a Shard directly, through a serialize/parse round trip so that it
// checks what the wire would.
#pragma once

#include <cohort/env.h>

#include "ps/status.h"
#include "ps.pb.h"

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

namespace cohort::ps {

class Shard;

// HTTP/2 settings of both ends: the largest frame HTTP/2 allows, and a 64 MB stream window.
constexpr int kHttp2MaxFrame = (1 << 24) - 1;
constexpr int kHttp2Window = 64 << 20;

// Trailing metadata a shard puts on an UNAVAILABLE it answers itself ("not initialized yet"), so
// that the client can tell "the shard answered" from "nothing reached it" (both UNAVAILABLE).
constexpr char kShardAnsweredKey[] = "cohort-shard-answered";

// Metadata every call carries: the bytes of its request (a stream's messages together), as a
// decimal number. A shard refuses a request over its cap, or one that declares nothing, on this
// header, before reading the body where it checks proofs first (TLS, loopback); the bytes that
// arrive are checked against the cap and the declaration again (ps/service.cpp).
constexpr char kRequestBytesKey[] = "cohort-request-bytes";

// One call's retries end after at most this many times its timeout in all (see makeGrpcClient).
constexpr int kRetryBoundTimeouts = 3;

// ClientOptions::pushChunkBytes unless told otherwise.
constexpr size_t kDefaultPushChunkBytes = size_t(4) << 20;

// A push on the zero-copy path (ps/frame.h): float32 values only, no codec, not row-sparse.
struct FramedPush {
  wire::PushRequest request;  // values: each piece's key, numel and dtype FLOAT32, with empty data
  std::vector<std::span<const float>> payload;  // values[i]'s floats, sent from where they lie
  std::shared_ptr<const void> keepAlive;  // owns that memory until the transport lets go of it
};

// Where the floats of a framed reply's piece go.
struct FrameTarget {
  uint32_t key = 0;
  std::span<float> values;  // the piece's numel floats
};

class ShardClient {
 public:
  virtual ~ShardClient() = default;
  virtual Status init(const wire::InitRequest& request, wire::InitReply* reply) = 0;
  virtual Status pull(const wire::PullRequest& request, wire::PullReply* reply) = 0;
  virtual Status push(const wire::PushRequest& request, wire::PushReply* reply) = 0;
  // The zero-copy push. The reply's values carry headers only; their floats are written straight
  // into `into` (one target per piece of the reply, in order; empty without want_values), and only
  // after the reply's pieces were checked against the targets' keys and sizes: a reply that does
  // not match writes nothing and fails with INTERNAL (the shard is at fault, not the caller).
  virtual Status pushFramed(const FramedPush& push, std::span<const FrameTarget> into, wire::PushReply* reply) = 0;
  virtual Status done(const wire::DoneRequest& request, wire::DoneReply* reply) = 0;
  virtual Status stats(const wire::StatsRequest& request, wire::StatsReply* reply) = 0;
  virtual std::string address() const = 0;
};

// An attempt of a call that failed with UNAVAILABLE and is about to be retried.
struct RetryEvent {
  bool shardAnswered = false;  // the shard itself refused it (not initialized yet); false: unreachable
  double callSeconds = 0;      // since the call's first attempt
  double spellSeconds = 0;     // since the first failure of this kind in a row (this spell)
};

struct ClientOptions {
  std::string authToken;      // every call proves it (ps/call_auth.h), never sends it; empty: none
  std::string tlsCaFile;      // PEM roots that sign the servers' certificates; empty: plaintext
  // How long one spell of an unreachable (or refusing) shard is retried; a call's retries end after
  // kRetryBoundTimeouts x this in all; one attempt's deadline is 2x + 5 s.
  double timeoutSeconds = 60;
  bool quiet = false;  // no line when a shard stops or starts answering
  // Called (from the calling thread) after each attempt that failed with UNAVAILABLE, before the
  // back-off, when the call will be retried; tests wait on it instead of sleeping.
  std::function<void(const RetryEvent&)> onRetry;
  // A zero-copy push of more than this many bytes goes as a stream of chunks of whole pieces, each
  // of at most this many bytes (a larger piece alone), which the shard checks as they arrive (the
  // PushStream call); a smaller push, or any push when 0, goes as one message (PushFramed).
  size_t pushChunkBytes = kDefaultPushChunkBytes;
  Env* env = nullptr;  // where those lines go; null: Env::standard()
};

// Whether both clients send `push` as a stream (PushStream) under ClientOptions::pushChunkBytes:
// only when it is more than one chunk. A push that fits in one has nothing to overlap, and the
// stream's extra message and per-message waits made the cnn's 2.2 MB pushes slower
// (docs/BENCHMARKS.md, "The streamed push").
bool pushStreams(const FramedPush& push, size_t chunkBytes);

// Pushes and pulls allocate and free buffers of tens of MB every step; glibc serves each from a
// fresh mmap and unmaps it on free, so every byte costs a page fault, twice a step. This makes
// freed memory stay in the process's heap for reuse instead. Called by shards and ps workers.
void keepFreedMemory();

// For a shard's process, after keepFreedMemory and before any thread starts: every thread
// allocates from the main heap, which keepFreedMemory keeps. glibc gives a thread a heap of its
// own and unmaps it whenever it empties, so a request of the model's size, read or answered by a
// gRPC thread, was faulted in afresh every call; with one heap the shard's streamed push and
// pull of 58 MB moved 1.5-1.9 GB/s before and 2.0-2.1 after (bench/ps_bandwidth, issue 30). Not
// for a worker: its compute threads would contend for the one heap's lock.
void allocateFromOneHeap();

// pushChunkBytes: as ClientOptions's (the fake's pushes go through Shard::beginStream and its
// chunks when > 0); 0 by default.
std::unique_ptr<ShardClient> makeFakeClient(std::shared_ptr<Shard> shard, std::string name = "fake",
                                            size_t pushChunkBytes = 0);

// A client of the shard at host:port. Calls that fail with UNAVAILABLE (the shard is down or
// restarting, or not initialized yet) are retried with exponential back-off (50 ms doubling to
// 2 s, from 50 ms again whenever the shard starts or stops answering). While the shard is
// unreachable the back-off is spent waiting on the channel, which gRPC tries to connect at least
// every 0.5 s: a shard that listens again is called within about that. The window is per spell:
// a call gives up once the shard has been unreachable for timeoutSeconds since the first failure
// after its last answer (or since the call began), or has refused it ("not initialized yet") for
// timeoutSeconds in a row. So a call begun before a shard was killed gets a whole window for the
// shard's restart, however long it had waited before. Spells can follow each other (refused at the
// start until the chief's Init, then cut off by a restart), so a call's retries also end after
// kRetryBoundTimeouts x timeoutSeconds in all: no call waits for ever. Every error on giving up
// names the shard, how long, and the timeout to raise. Throws InvalidArgument when a TLS file
// cannot be read.
std::unique_ptr<ShardClient> makeGrpcClient(const std::string& address, const ClientOptions& options);

}  // namespace cohort::ps
