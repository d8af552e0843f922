// One parameter-server shard: its pieces of the model, the optimizer, and the update policy that
// decides when a pushed gradient is applied, held, or dropped (ps/update_policy.h, one class per
// mode, working on this shard's state under its lock). Transport-free: the gRPC service
// (ps/service.h) and the in-process fake transport (ps/client.h) both call it, so every policy is
// tested without sockets.
//
// Policies (wire::Policy.mode):
//   sync      Each step, the pushes of all N workers (N-K with backup_workers K) are summed,
//             averaged and applied; each pusher is held until its step closes. A push computed on
//             an older version than the current one arrived after its step closed: dropped (late).
//             A step that waits longer than the timeout fails the shard, naming the missing
//             workers; with backup workers, workers that stay silent that long are counted lost.
//   async     Each push is applied on arrival.
//   softsync  Pushes are summed; every `softsync` of them are averaged and applied. The last
//             group, short when no worker can push any more (done, lost or finishing), is applied
//             averaged over what it holds, before the chief's final pull.
//   ssp       As async, but a worker that has pushed c steps is held until c - (slowest worker's
//             steps) <= staleness_bound. Workers done, lost (silent for the timeout) or finishing
//             (their last push made) no longer count as the slowest.
// Asynchronous modes also take: staleness_lr inverse (scale by 1/tau), max_staleness T (drop when
// tau > T), warmup_steps W (until version W only worker 0's pushes are applied; others' are held,
// then dropped). tau = version at apply (or drop) - the version the gradient was computed on.
//
// With push == "updates" the workers run the optimizer themselves and the shard adds the
// (averaged, under sync and softsync) updates to the values; it keeps no optimizer state (none in
// its checkpoints), and a resume does not compare optimizers.
#pragma once

#include <cohort/env.h>

#include "base/clock.h"
#include "base/thread_annotations.h"
#include "ps.pb.h"
#include "ps/status.h"
#include "ps/wire.h"

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

namespace cohort {
class CheckpointStore;
}

namespace cohort::ps {

class FramePayload;
class ServerOptimizer;
class UpdatePolicy;

struct ShardOptions {
  std::string name = "ps 0";   // in messages and logs
  std::string checkpointDir;   // empty: no checkpoints
  // Where the shard reports what it refuses, loses or recovers; default: env's log, as
  // "NAME: MESSAGE".
  std::function<void(const std::string&)> log;
  // Its messages (without `log`), its clock (workers' silence, held pushes) and its fault points:
  // "ps.shard.version" each time the shard reaches a version (the value); null: Env::standard().
  Env* env = nullptr;
  // This process was started again alone by its launcher inside a running job (cohort launch's
  // COHORT_RESTARTED_ALONE=1): the checkpoint it restores is that job's own, so a worker's first
  // pull (marked `initial`) is served from it at once. (Not after a group restart: there a worker
  // served before the chief's resume Init could push, be held, and be aborted by that Init.) Otherwise a restored shard answers a first
  // pull only after an Init, so that a new job never trains on an old run's state before its chief
  // has chosen between a fresh start and --resume; but a worker still retrying its first pull
  // when the shard died would then wait for an Init the running chief never sends again.
  bool restartedInJob = false;
  // Testing: called with the version about to be written, after the state was copied and the
  // shard's lock released (pushes and pulls go on while a checkpoint is written).
  std::function<void(uint64_t version)> beforeCheckpointWrite;
  // Testing: called when an ssp push of `worker`, about to start step `clock`, is held because the
  // slowest live worker is at `slowest`, or when a retry of a sync push of `clock` waits for the
  // push it repeats (`slowest` -1). Under the shard's lock: it must not call the shard.
  std::function<void(uint32_t worker, int64_t clock, int64_t slowest)> onHeld;
  // Testing: called when a streamed push's chunk has been taken in (applied, gathered or kept),
  // with the first piece not received yet; without the shard's lock.
  std::function<void(uint32_t worker, size_t nextPiece)> afterChunk;
};

class Shard {
 public:
  // Loads the newest readable checkpoint from options.checkpointDir when there is one.
  explicit Shard(ShardOptions options);
  ~Shard();
  Shard(const Shard&) = delete;
  Shard& operator=(const Shard&) = delete;

  Status init(const wire::InitRequest& request, wire::InitReply* reply);
  Status pull(const wire::PullRequest& request, wire::PullReply* reply);
  // May block, as the policy says, for at most the policy's timeout.
  Status push(const wire::PushRequest& request, wire::PushReply* reply);
  // The zero-copy push (ps/frame.h), float32 values only (no codec, not row-sparse):
  // request.values carry each piece's key, numel and dtype, their floats lie in `payload` and are
  // read where they lie when aligned. With want_values the reply's values carry the same headers
  // and their floats are appended to *replyValues, in order. Same policies and checks as push().
  Status pushFramed(const wire::PushRequest& request, const FramePayload& payload, wire::PushReply* reply,
                    std::vector<float>* replyValues);
  // A push streamed in chunks (the PushStream call, ps/frame.h): float32 values only, as for
  // pushFramed. beginStream checks the header (request.values: each piece's key, numel and dtype,
  // no data) before any chunk is read and decides, as push() would at that moment, what becomes of
  // the push: applied (async, ssp), added to the step or group being gathered (sync, softsync), or
  // kept for the end (a duplicate, a sync push already late, a warm-up push, a stale one). addChunk
  // checks each chunk (in order, whole pieces, the payload's length, NaN and Inf) and then, when
  // the push is applied or gathered, applies or adds its pieces at once, piece by piece under the
  // shard's lock, while the next chunk is still on the wire; finishStream counts the push as one
  // update (the version, staleness, the worker's clock, sync's step, softsync's group, ssp's hold)
  // once every piece is in, and makes the reply. The guarantee is per chunk: a chunk's pieces are
  // applied only if the whole chunk is valid, and a stream that fails midway (a bad chunk, an
  // early end, a cancel: refuseStream) leaves the pieces already applied, is not counted as an
  // update (no version, no clock) and is counted in partial_pushes and logged. Each piece keeps its
  // own optimizer step count, so another worker's push may apply between two pieces of this one
  // and each piece's state stays that of a sequence of whole updates (as each shard's is when a
  // push goes to several). A push kept for the end reads its floats where they lie in `payload`,
  // which the caller then keeps alive until finishStream returns (Stream::keepsChunks).
  struct Stream;
  Status beginStream(const wire::PushRequest& request, std::unique_ptr<Stream>* stream);
  Status addChunk(Stream& stream, const wire::PushChunk& chunk, const FramePayload& payload);
  Status finishStream(Stream& stream, wire::PushReply* reply, std::vector<float>* replyValues);
  // A stream the transport ends before its last chunk (a chunk that does not parse, a cancel):
  // counted as rejected, and as partial when some pieces were applied. Once per stream. Returns
  // the error for the worker: `why`, and which pieces were applied and stay, if any.
  Status refuseStream(Stream& stream, const Status& why);
  // A push the transport could not even read as one (a frame that does not parse, a stream cut
  // off before its header was admitted): counted and logged as a refused push.
  void countRejected(const Status& why);
  Status done(const wire::DoneRequest& request, wire::DoneReply* reply);
  Status stats(const wire::StatsRequest& request, wire::StatsReply* reply);

  // A request refused by the transport for its credentials.
  void countUnauthenticated();

  // Blocks until every worker is done or lost (returns nullopt) or the shard failed (returns
  // why), or until `timeout` passes (returns nullopt; check finished()). Writes a final
  // checkpoint first when every worker is done.
  std::optional<std::string> waitFinished(std::chrono::milliseconds timeout);
  bool finished() const;

  // Writes a checkpoint now (no-op without a checkpoint directory or before Init). The state is
  // copied under the lock and written outside it: pushes are not held while it is written.
  void checkpoint();

  // Once finished(): why the final checkpoint (written when every worker is done) could not be
  // written, one line naming the shard, its directory and the cause; nullopt when it was, or when
  // the shard writes none. A periodic checkpoint that fails is logged and counted in the stats
  // (checkpoints_failed, checkpoint_error) and training goes on from the previous one; the final
  // one failing is the run's end without a state to resume from, so the server exits non-zero
  // (serveShard) and the chief's Done reply carries it.
  std::optional<std::string> finalCheckpointError() const;

  // The server is going down: every held push is let go at once with ABORTED and `reason`, and
  // so is every later call.
  void stop(const std::string& reason);

 private:
  // The update policies work on the state below, under mu_ (update_policy.h).
  friend class UpdatePolicy;
  friend class SyncPolicy;
  friend class AsyncPolicy;
  friend class SoftSyncPolicy;
  friend class SspPolicy;

  struct Worker;
  Status checkWorker(uint32_t worker) const REQUIRES(mu_);
  // Init's two ways: the chief resumes this shard's state (same model, workers and optimizer; the
  // policy and learning rate may change), or starts afresh from its values, replacing the state
  // and every checkpoint. A fresh start is refused when the state could not fit one checkpoint.
  Status resumeLocked(const wire::InitRequest& request, wire::InitReply* reply) REQUIRES(mu_);
  Status checkFitsCheckpoint(const wire::InitRequest& request, const std::vector<wire::PieceSpec>& pieces) const;
  void startAfreshLocked(const wire::InitRequest& request, const std::vector<wire::PieceSpec>& pieces) REQUIRES(mu_);
  // No gradient pending: sized to the values, pieces and workers set just before.
  void clearPendingLocked() REQUIRES(mu_);
  // A push's values for one piece, in the shard's order (views into the request or a scratch
  // buffer): the whole piece (rows empty), or some of its rows, values side by side (row-sparse).
  struct Part {
    std::span<const float> values;
    std::span<const uint32_t> rows;
    size_t numel = 0;    // the piece's elements
    size_t rowDim = 0;   // > 0: values are `rows` rows of this width
    bool noGradient = false;  // the worker had none for it (wire.h's isNoGradient): no values
    bool alreadyIn = false;   // applied or gathered by a cut attempt of the same push: not again
  };
  using Parts = std::vector<Part>;
  // One piece (k, starting at element `at`): an optimizer step at the piece's own count, or (push
  // updates) the update added; and the same into the step or group being gathered. A part without
  // a gradient is not applied (no step: the piece and its optimizer state stay as they are); one
  // gathered counts in the piece's average as zeros. A part alreadyIn does nothing.
  void applyPieceLocked(size_t k, size_t at, const Part& part, float scale) REQUIRES(mu_);
  void accumulatePieceLocked(size_t k, size_t at, const Part& part, float scale) REQUIRES(mu_);
  // Every piece, then the version (one update).
  void applyLocked(const Parts& parts, float scale) REQUIRES(mu_);
  void accumulateLocked(const Parts& parts, float scale) REQUIRES(mu_);
  // An update's end: the version bumped, waiters woken, a checkpoint asked for when due.
  void finishUpdateLocked() REQUIRES(mu_);
  // Whether piece k of `worker`'s push of `clock` is to be applied or gathered now: not when an
  // earlier attempt of that push (a stream cut midway, being retried) has it in already. Counts it
  // in when so; pieces come in order.
  bool takePieceLocked(uint32_t worker, int64_t clock, size_t k) REQUIRES(mu_);
  // The pieces of this push (its worker and clock) an earlier, cut attempt of it applied or
  // gathered (Worker::piecesIn), logged when there are any.
  size_t piecesInLocked(const wire::PushRequest& request) const REQUIRES(mu_);
  // Marks the parts of a whole push that an earlier, cut attempt of it applied or gathered.
  void markPiecesInLocked(const wire::PushRequest& request, Parts& parts) REQUIRES(mu_);
  // A streamed push that will not count as an update ends (refused, cut, late, aborted).
  // Returns `why`, saying which pieces stay applied, if any.
  Status endStreamLocked(Stream& stream, const Status& why, bool rejected) REQUIRES(mu_);
  void fillReplyLocked(const wire::PushRequest& request, wire::PushReply* reply, std::vector<float>* framed)
      REQUIRES(mu_);
  void applyPendingLocked() REQUIRES(mu_);
  void noteStalenessLocked(int64_t tau) REQUIRES(mu_);
  // framed: the values' headers only in out, their floats appended to *framed.
  void fillValuesLocked(google::protobuf::RepeatedPtrField<wire::Tensor>* out, std::vector<float>* framed = nullptr)
      REQUIRES(mu_);
  void markLostLocked(std::chrono::steady_clock::time_point now) REQUIRES(mu_);
  // The checks every push passes first (protocol, initialized, worker); gives the layout, and the
  // Init it belongs to (generation_) when `generation` is given.
  Status admitPush(const wire::PushRequest& request, std::vector<wire::PieceSpec>* pieces,
                   uint64_t* generation = nullptr) EXCLUDES(mu_);
  // framed: the push's floats are there (pushFramed); streamed: they were checked as they arrived
  // (finishStream). Either way the reply's floats go to *replyValues. Checks and decodes the push
  // outside the lock (a large push does not stall the others), admits it under the lock, then
  // hands it to the update policy (updatePolicy_).
  Status handlePush(const wire::PushRequest& request, const FramePayload* framed, const Stream* streamed,
                    wire::PushReply* reply, std::vector<float>* replyValues) EXCLUDES(mu_);

  // A push's values checked and decoded, outside the lock (shard_push.cpp).
  struct DecodedPush;
  void decodePush(const wire::PushRequest& request, const FramePayload* framed, const Stream* streamed,
                  const std::vector<wire::PieceSpec>& pieces, DecodedPush& out) const;
  // Under the lock: a push the shard refuses now (a bad clock, an Init since it was admitted under
  // `admitted`, a failed shard) is counted and its error returned; Ok admits it.
  Status acceptLocked(const wire::PushRequest& request, const DecodedPush& decoded, const Stream* streamed,
                      uint64_t admitted) REQUIRES(mu_);

  // A push admitted under the lock, on its way through the update policy to its reply. Lives on
  // handlePush's stack; `id` indexes workers_, never a reference across a wait (an Init while the
  // push is held may replace workers_; `generation` tells).
  struct HeldPush {
    const wire::PushRequest& request;
    wire::PushReply* reply;
    std::vector<float>* replyValues;
    const Stream* streamed;  // a streamed push, or null
    bool early;              // streamed, its pieces applied or gathered as they arrived (Stream::Plan)
    const Parts& grad;       // its values (unused when early)
    std::chrono::steady_clock::time_point arrived;
    uint32_t id;          // the worker
    uint64_t generation;  // the Init it was admitted under
    uint64_t pulled;      // the version its gradient was computed from (at most the shard's)
    std::string dropped;  // why it was not applied: late, stale, warmup, stopped; empty: applied
  };
  // The worker heard from; a retry of a push already handled is answered as a duplicate (true).
  bool noteArrivalLocked(HeldPush& push) REQUIRES(mu_);
  void replyDuplicateLocked(HeldPush& push) REQUIRES(mu_);
  // A retry of the worker's push still held (Worker::heldClock): waits until that one is let go,
  // then answers as a duplicate, with the values it let the first go with.
  Status awaitHeldOriginalLocked(HeldPush& push) REQUIRES(mu_);
  void countPushLocked(const HeldPush& push, int64_t pushedBytes) REQUIRES(mu_);

  // The reply: the worker's clock, the version, the wait, the values when asked for. The update
  // policy calls it when it lets the push go.
  Status finishPushLocked(HeldPush& push, bool applied) REQUIRES(mu_);
  int64_t stalenessLocked(const HeldPush& push) const REQUIRES(mu_);
  void maybeCheckpointLocked() REQUIRES(mu_);
  void checkpointLocked() REQUIRES(mu_);
  // The state as a checkpoint, and the run it is of (run_ when it was copied).
  struct Snapshot {
    wire::ShardCheckpoint state;
    uint64_t run = 0;
  };
  // The state now (nullopt without a store or before Init), and its writing, which takes writeMu_
  // only: never mu_, so that pushes go on meanwhile.
  std::optional<Snapshot> snapshotLocked() REQUIRES(mu_);
  // Returns why the write failed (the store's message, naming the file and the errno text). A
  // snapshot of an earlier run (a fresh Init came since it was copied, and removed that run's
  // checkpoints) is not written.
  std::optional<std::string> writeCheckpoint(const Snapshot& snapshot) EXCLUDES(writeMu_);
  void noteCheckpointFailedLocked(const std::string& error) REQUIRES(mu_);
  // Writes the checkpoint maybeCheckpointLocked() asked for, if any; called without mu_.
  void writeDueCheckpoint() EXCLUDES(mu_);
  bool loadCheckpoint();
  bool restoreFrom(const std::string& path, const std::vector<uint8_t>& bytes);
  // softsync: the group being gathered, short of `softsync` gradients, once no worker can push
  // any more (each done, lost or finishing): applied, averaged over what it holds, so that the
  // chief's final pull and the final checkpoint have it (its gradients were counted as applied).
  void applyLastGroupLocked() REQUIRES(mu_);
  void finishIfAllDoneLocked() REQUIRES(mu_);
  void log(const std::string& message) const;
  // The shard's clock: its Env's (ShardOptions::env), so that a test may move it. Workers' last
  // contact, held pushes and the lost-worker timeout are measured on it; the waits themselves
  // (CondVar) are on the steady clock, in ticks.
  Clock::time_point now() const { return envOrStandard(options_.env).now(); }

  // Constant after construction.
  ShardOptions options_;
  std::unique_ptr<CheckpointStore> store_;

  // Everything below is guarded by mu_ (held pushes wait on changed_, which releases it).
  mutable Mutex mu_;
  CondVar changed_;
  bool initialized_ GUARDED_BY(mu_) = false;
  bool initSinceStart_ GUARDED_BY(mu_) = false;  // an Init came since this process started (not only a restore)
  uint64_t generation_ GUARDED_BY(mu_) = 0;      // bumped by every Init: a held push under an older one gives up
  wire::Policy policy_ GUARDED_BY(mu_);
  // Made from policy_ with it (UpdatePolicy::make); never null once initialized_.
  std::shared_ptr<const UpdatePolicy> updatePolicy_ GUARDED_BY(mu_);
  std::vector<wire::PieceSpec> pieces_ GUARDED_BY(mu_);
  std::vector<float> values_ GUARDED_BY(mu_);
  std::unique_ptr<ServerOptimizer> optimizer_ GUARDED_BY(mu_);
  // Per piece: the optimizer steps applied to it (the step number its next update runs at).
  std::vector<int64_t> pieceSteps_ GUARDED_BY(mu_);
  uint64_t version_ GUARDED_BY(mu_) = 0;
  std::vector<Worker> workers_ GUARDED_BY(mu_);
  // sync and softsync: the step being gathered
  std::vector<float> pending_ GUARDED_BY(mu_);
  // Row-sparse pieces under sync and softsync: per piece, the rows pending_ holds (marked, and
  // listed in arrival order), so that a step applies and clears those rows alone.
  std::vector<std::vector<uint8_t>> pendingMarked_ GUARDED_BY(mu_);
  std::vector<std::vector<uint32_t>> pendingRows_ GUARDED_BY(mu_);
  int pendingCount_ GUARDED_BY(mu_) = 0;  // pushes counted in the step or group (whole ones)
  // Per piece: the gradients added to it in this step or group (pendingCount_, but for the pieces
  // of streamed pushes that ended midway, or that a sync step closed on midway). Each piece is
  // averaged over its own.
  std::vector<int> pendingPieceCount_ GUARDED_BY(mu_);
  // Per piece: some push in the step or group had a gradient for it; a piece none had one for is
  // left alone when the step or group is applied.
  std::vector<uint8_t> pendingPieceGradient_ GUARDED_BY(mu_);
  std::vector<bool> pendingFrom_ GUARDED_BY(mu_);
  std::optional<std::string> failure_ GUARDED_BY(mu_);
  bool finished_ GUARDED_BY(mu_) = false;
  bool stopJob_ GUARDED_BY(mu_) = false;  // the chief asked every worker to stop (not checkpointed)
  uint64_t lastCheckpointVersion_ GUARDED_BY(mu_) = 0;  // the last one copied for writing
  bool checkpointDue_ GUARDED_BY(mu_) = false;           // checkpoint_every updates since it
  std::optional<Snapshot> nextCheckpoint_ GUARDED_BY(mu_);  // copied, to be written
  bool writingCheckpoints_ GUARDED_BY(mu_) = false;      // a pusher is writing them (writeDueCheckpoint)
  std::optional<std::string> finalCheckpointError_ GUARDED_BY(mu_);
  // Serializes the writing of checkpoints (store_ is not thread-safe). Taken after mu_ or alone,
  // never the other way round.
  mutable Mutex writeMu_;
  // Fresh Inits so far: changed only under mu_ and writeMu_ both, so either lock reads it still.
  std::atomic<uint64_t> run_{0};
  wire::StatsReply stats_ GUARDED_BY(mu_);
  double stalenessSum_ GUARDED_BY(mu_) = 0;
};

// One streamed push being received (Shard::beginStream): the caller only passes it back.
struct Shard::Stream {
  // What becomes of the push's pieces as they arrive (decided by beginStream).
  enum class Plan {
    kAtTheEnd,    // kept, and handled whole by finishStream (dropped or refused there)
    kApply,       // applied chunk by chunk (async, ssp)
    kAccumulate,  // added chunk by chunk to the step (sync) or group (softsync) being gathered
  };
  // Whether the caller must keep every chunk's bytes until finishStream (kAtTheEnd reads them
  // there); otherwise a chunk's bytes are done with once addChunk returns.
  bool keepsChunks() const { return plan == Plan::kAtTheEnd; }

  wire::PushRequest request;
  std::vector<wire::PieceSpec> pieces;        // the shard's layout when the stream began
  std::vector<std::span<const float>> dense;  // kAtTheEnd: each piece's floats, once its chunk has arrived
  std::vector<FloatScratch> copies;           // pieces that did not lie float-aligned in one slice
  size_t nextPiece = 0;                       // the first piece not received yet
  int64_t bytes = 0;                          // payload received
  Plan plan = Plan::kAtTheEnd;
  uint64_t generation = 0;  // the shard's Init when the plan was made: a new one ends the push
  uint64_t version = 0;     // the version then (sync: the step the push belongs to)
  int64_t tau = 0;          // its staleness then
  float scale = 1.0f;       // staleness_lr's factor
  size_t applied = 0;       // pieces applied or gathered so far (or in already: Worker::piecesIn)
  bool ended = false;       // refused or aborted: counted once
};

}  // namespace cohort::ps
