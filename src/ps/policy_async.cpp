// async (update_policy.h), and the warm-up and staleness remedies softsync and ssp inherit.
#include "base/clock.h"
#include "ps/shard_internal.h"
#include "ps/update_policy.h"

namespace cohort::ps {

using namespace shard_internal;

Status AsyncPolicy::push(Shard& shard, Shard::HeldPush& push) const {
  if (!push.early && inWarmup(shard, push.id)) return holdForWarmup(shard, push);
  // A stream applied as it arrived keeps the staleness, and so the scale, of when it began.
  const int64_t tau = push.early ? push.streamed->tau : shard.stalenessLocked(push);
  push.reply->set_staleness(tau);
  if (!push.early && tooStale(tau)) {
    push.dropped = "stale";
    shard.stats_.set_dropped_stale(shard.stats_.dropped_stale() + 1);
  } else {
    shard.noteStalenessLocked(tau);
    shard.stats_.set_applied(shard.stats_.applied() + 1);
    absorb(shard, push, scaleFor(tau));
  }
  if (Status s = holdAfterAbsorbing(shard, push); !s.ok()) return s;
  return finish(shard, push, push.dropped.empty());
}

void AsyncPolicy::planStream(const Shard& shard, Shard::Stream& stream) const {
  if (inWarmup(shard, stream.request.worker()) || tooStale(stream.tau)) return;  // dropped, at the end
  stream.scale = scaleFor(stream.tau);
  stream.plan = absorbPlan();
}

void AsyncPolicy::absorb(Shard& shard, const Shard::HeldPush& push, float scale) const {
  if (push.early) {
    shard.finishUpdateLocked();  // its pieces are applied
  } else {
    shard.applyLocked(push.grad, scale);
  }
}

Shard::Stream::Plan AsyncPolicy::absorbPlan() const { return Shard::Stream::Plan::kApply; }

Status AsyncPolicy::holdAfterAbsorbing(Shard&, Shard::HeldPush&) const { return Status::Ok(); }

Status AsyncPolicy::finish(Shard& shard, Shard::HeldPush& push, bool applied) const {
  return shard.finishPushLocked(push, applied);
}

bool AsyncPolicy::inWarmup(const Shard& shard, uint32_t worker) const {
  return policy_.warmup_steps() > 0 && worker != 0 && shard.version_ < uint64_t(policy_.warmup_steps());
}

Status AsyncPolicy::holdForWarmup(Shard& shard, Shard::HeldPush& push) const {
  // Worker 0 trains alone until version W; the others wait, then start from its parameters.
  // A push is held for at most the timeout (the worker then pushes again and is held again), so
  // that no call outlives the client's deadline; the held worker counts as heard from.
  const auto limit = std::chrono::duration<double>(policy_.timeout_s());
  auto progress = shard.now();
  uint64_t seen = shard.version_;
  while (shard.version_ < uint64_t(policy_.warmup_steps()) && !shard.failure_ && !shard.stopJob_) {
    shard.changed_.waitFor(shard.mu_, kTick);
    if (shard.generation_ != push.generation) return reinitializedWhileHeld();
    const auto now = shard.now();
    shard.workers_[push.id].lastSeen = now;
    if (shard.version_ != seen) {
      seen = shard.version_;
      progress = now;
    } else if (shard.workers_[0].done || shard.workers_[0].lost || now - progress > limit) {
      break;  // worker 0 will not finish the warm-up: go on without it
    }
    if (now - push.arrived > limit) break;
  }
  if (shard.failure_) return Status::error(Code::kAborted, *shard.failure_);
  push.dropped = "warmup";
  push.reply->set_staleness(shard.stalenessLocked(push));
  shard.stats_.set_dropped_warmup(shard.stats_.dropped_warmup() + 1);
  return finish(shard, push, false);
}

bool AsyncPolicy::tooStale(int64_t tau) const { return policy_.max_staleness() >= 0 && tau > policy_.max_staleness(); }

float AsyncPolicy::scaleFor(int64_t tau) const {
  return (policy_.staleness_lr() == wire::STALENESS_LR_INVERSE && tau > 1) ? 1.0f / float(tau) : 1.0f;
}

}  // namespace cohort::ps
