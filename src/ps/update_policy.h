// The update policies of a Shard, one per --ps-mode (shard.h's header comment says what each does):
// what becomes of an admitted push and how long it is held, and how a streamed push's pieces are
// taken as they arrive. One is made from the wire::Policy at each Init (and at a restore), and
// holds nothing but that policy's parameters: the state they work on (the values, the step or
// group being gathered, the workers, the version) stays in the Shard, guarded by its mutex. Every
// method that reads it takes the shard and runs under that mutex (REQUIRES(shard.mu_)), so clang's lock check
// covers the policies as it covers the shard. A held push waits on the shard's changed_, which
// releases the mutex, and after each wait checks that no Init replaced the state (generation); the
// Init replaces the shard's policy too, so a held push keeps its own alive (shared_ptr).
//
// sync (policy_sync.cpp) stands alone; async (policy_async.cpp) holds the warm-up and the staleness
// remedies, which softsync (policy_softsync.cpp) and ssp (policy_ssp.cpp) inherit, changing what
// absorbing a gradient and holding a pusher mean.
#pragma once

#include "base/thread_annotations.h"
#include "ps.pb.h"
#include "ps/shard.h"
#include "ps/status.h"

#include <cstdint>
#include <memory>

namespace cohort::ps {

class UpdatePolicy {
 public:
  // The policy's mode picks the implementation; checkPolicy has accepted `policy`.
  static std::shared_ptr<const UpdatePolicy> make(const wire::Policy& policy);
  virtual ~UpdatePolicy() = default;
  UpdatePolicy(const UpdatePolicy&) = delete;
  UpdatePolicy& operator=(const UpdatePolicy&) = delete;

  // A push admitted and counted (not a duplicate, Shard::noteArrivalLocked): applied, gathered or
  // dropped (push.dropped says why), held as long as the policy says, then answered
  // (Shard::finishPushLocked). Errors: the shard failed, or an Init came while it was held.
  virtual Status push(Shard& shard, Shard::HeldPush& push) const REQUIRES(shard.mu_) = 0;
  // Shard::beginStream, for a stream the shard can take: sets stream.plan (and stream.scale) to
  // what push() would do with it now; leaves kAtTheEnd for what push() would drop (late, warm-up,
  // stale). stream.version and stream.tau are those of now.
  virtual void planStream(const Shard& shard, Shard::Stream& stream) const REQUIRES(shard.mu_) = 0;
  // Shard::addChunk, for a stream planned kAccumulate: whether its next piece still joins what is
  // being gathered (sync: not once the step it began in has closed; it is late then).
  virtual bool stillGathering(const Shard& shard, const Shard::Stream& stream) const REQUIRES(shard.mu_);

 protected:
  explicit UpdatePolicy(const wire::Policy& policy) : policy_(policy) {}
  const wire::Policy policy_;
};

// Each step, the pushes of all live workers (less the backup workers) are summed, averaged and
// applied, and every pusher is held until its step closes; a push from an older step is late.
class SyncPolicy final : public UpdatePolicy {
 public:
  explicit SyncPolicy(const wire::Policy& policy) : UpdatePolicy(policy) {}
  Status push(Shard& shard, Shard::HeldPush& push) const override REQUIRES(shard.mu_);
  void planStream(const Shard& shard, Shard::Stream& stream) const override REQUIRES(shard.mu_);
  bool stillGathering(const Shard& shard, const Shard::Stream& stream) const override REQUIRES(shard.mu_);

 private:
  bool isLate(const Shard& shard, const Shard::HeldPush& push) const REQUIRES(shard.mu_);
  // Its step closed without it (backup workers), or it already gave a gradient for this one.
  Status dropLate(Shard& shard, Shard::HeldPush& push) const REQUIRES(shard.mu_);
  // Held until `step` closes, the shard fails or the job stops.
  Status holdUntilClosed(Shard& shard, Shard::HeldPush& push, uint64_t step) const REQUIRES(shard.mu_);
  // The step closes once enough workers gave a gradient (all live ones, less the backup workers).
  void closeStepIfReady(Shard& shard, uint64_t step) const REQUIRES(shard.mu_);
  // A worker lost without a gradient for `step` fails the shard (without backup workers).
  void failOnLostWorkers(Shard& shard, uint64_t step) const REQUIRES(shard.mu_);
};

// Each push is applied on arrival, after the remedies every asynchronous mode shares: during the
// warm-up (warmup_steps W) only worker 0's pushes count, the others' are held until version W (at
// most the timeout) and dropped; a push staler than max_staleness is dropped; staleness_lr
// inverse scales it by 1/tau.
class AsyncPolicy : public UpdatePolicy {
 public:
  explicit AsyncPolicy(const wire::Policy& policy) : UpdatePolicy(policy) {}
  Status push(Shard& shard, Shard::HeldPush& push) const final REQUIRES(shard.mu_);
  void planStream(const Shard& shard, Shard::Stream& stream) const final REQUIRES(shard.mu_);

 protected:
  // The gradient, scaled, into the parameters (async, ssp) or the group (softsync).
  virtual void absorb(Shard& shard, const Shard::HeldPush& push, float scale) const REQUIRES(shard.mu_);
  // What absorbing means for a stream's pieces as they arrive.
  virtual Shard::Stream::Plan absorbPlan() const;
  // After the push was absorbed or dropped, before its reply: ssp holds it there.
  virtual Status holdAfterAbsorbing(Shard& shard, Shard::HeldPush& push) const REQUIRES(shard.mu_);
  // The reply (Shard::finishPushLocked); ssp records its clock gap there too.
  virtual Status finish(Shard& shard, Shard::HeldPush& push, bool applied) const REQUIRES(shard.mu_);

 private:
  bool inWarmup(const Shard& shard, uint32_t worker) const REQUIRES(shard.mu_);
  Status holdForWarmup(Shard& shard, Shard::HeldPush& push) const REQUIRES(shard.mu_);
  bool tooStale(int64_t tau) const;
  float scaleFor(int64_t tau) const;
};

// As async, but pushes are gathered: every `softsync` of them are averaged and applied.
class SoftSyncPolicy final : public AsyncPolicy {
 public:
  explicit SoftSyncPolicy(const wire::Policy& policy) : AsyncPolicy(policy) {}

 protected:
  void absorb(Shard& shard, const Shard::HeldPush& push, float scale) const override REQUIRES(shard.mu_);
  Shard::Stream::Plan absorbPlan() const override;
};

// As async, but a worker that has pushed c steps is held until c - (the slowest live worker's
// steps) <= staleness_bound. Workers done, lost (silent for the timeout) or finishing (their last
// push made, waiting for the others) no longer count as the slowest.
class SspPolicy final : public AsyncPolicy {
 public:
  explicit SspPolicy(const wire::Policy& policy) : AsyncPolicy(policy) {}

 protected:
  // Held until this worker, about to start step clock+1, is at most the bound ahead.
  Status holdAfterAbsorbing(Shard& shard, Shard::HeldPush& push) const override REQUIRES(shard.mu_);
  Status finish(Shard& shard, Shard::HeldPush& push, bool applied) const override REQUIRES(shard.mu_);

 private:
  // The fewest steps of a live worker (neither done, lost nor finishing); INT64_MAX when none is.
  static int64_t slowestClock(const Shard& shard) REQUIRES(shard.mu_);
  // The ssp record, measured independently of the hold decision: how far the fastest worker that
  // is free to compute is ahead of the slowest live one (stats max_clock_gap).
  static void recordClockGap(Shard& shard) REQUIRES(shard.mu_);
};

}  // namespace cohort::ps
