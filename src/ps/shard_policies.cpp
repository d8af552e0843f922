// The update policies of a Shard, one per --ps-mode (see shard.h's pushSyncLocked): what becomes
// of a push once it is admitted, how long it is held, and its reply. Every function here runs
// under the shard's lock; a held push waits on changed_, which releases it, and after each wait
// checks that no Init replaced the layout meanwhile (generation).
#include "base/clock.h"
#include "ps/shard.h"
#include "ps/shard_internal.h"

#include <algorithm>

namespace cohort::ps {

using namespace shard_internal;

int64_t Shard::stalenessLocked(const HeldPush& push) const {
  return int64_t(version_ - std::min<uint64_t>(push.pulled, version_));
}

Status Shard::finishPushLocked(HeldPush& push, bool applied) {
  Worker& me = workers_[push.id];
  me.clock += 1;
  me.inClosedStep = false;
  me.lastSeen = Clock::now();
  if (policy_.mode() == wire::MODE_SSP) recordClockGapLocked();
  wire::PushReply* reply = push.reply;
  reply->set_applied(applied);
  reply->set_dropped(push.dropped);
  reply->set_version(version_);
  reply->set_samples_total(stats_.samples_total());
  const double held = secondsSince(push.arrived);
  reply->set_wait_s(held);
  reply->set_stop_job(stopJob_);
  stats_.set_wait_s(stats_.wait_s() + held);
  if (push.request.want_values()) fillReplyLocked(push.request, reply, push.replyValues);
  changed_.notifyAll();
  return Status::Ok();
}

// sync ------------------------------------------------------------------------------------------

void Shard::closeSyncStepIfReadyLocked(uint64_t step) {
  int live = 0;
  for (const auto& w : workers_) live += (!w.done && !w.lost && !w.finishing) ? 1 : 0;
  const int needed = std::max(1, std::min(int(policy_.workers() - policy_.backup_workers()), live));
  if (version_ != step || pendingCount_ < needed) return;
  for (size_t i = 0; i < workers_.size(); ++i) workers_[i].inClosedStep = pendingFrom_[i];
  applyPendingLocked();
}

void Shard::failOnLostWorkersLocked(uint64_t step) {
  const auto now = Clock::now();
  // Workers held in this step are alive: they are waiting on us.
  for (size_t i = 0; i < workers_.size(); ++i) {
    if (pendingFrom_[i]) workers_[i].lastSeen = std::max(workers_[i].lastSeen, now);
  }
  markLostLocked(now);
  std::string missing;
  for (size_t i = 0; i < workers_.size(); ++i) {
    if (workers_[i].lost && !pendingFrom_[i]) missing += (missing.empty() ? "" : ", ") + std::to_string(i);
  }
  if (missing.empty() || policy_.backup_workers() > 0) return;
  failure_ = "worker " + missing + " sent no gradient for step " + std::to_string(step) + " within " +
             seconds(policy_.timeout_s()) +
             ": it is lost, and sync mode needs every worker (--backup-workers K lets the others go on)";
  log(*failure_);
  changed_.notifyAll();
}

Status Shard::pushSyncLocked(HeldPush& push) {
  const uint64_t step = version_;
  // A gathered stream is late when its step closed while it arrived (some of its pieces made it).
  const bool late =
      push.early ? version_ != push.streamed->version : (push.request.pulled_version() < step || pendingFrom_[push.id]);
  if (late) {
    // Its step closed without it (backup workers), or it already gave a gradient for this one.
    push.dropped = "late";
    push.reply->set_staleness(stalenessLocked(push));
    stats_.set_dropped_late(stats_.dropped_late() + 1);
    return finishPushLocked(push, false);
  }
  if (push.early) {
    pendingCount_ += 1;  // its pieces are in
  } else {
    accumulateLocked(push.grad, 1.0f);
  }
  pendingFrom_[push.id] = true;
  push.reply->set_staleness(0);
  noteStalenessLocked(0);
  stats_.set_applied(stats_.applied() + 1);
  closeSyncStepIfReadyLocked(step);
  while (version_ == step && !failure_ && !stopJob_) {
    changed_.waitFor(mu_, kTick);
    if (generation_ != push.generation) return reinitializedWhileHeld();
    failOnLostWorkersLocked(step);
    if (failure_) break;
    closeSyncStepIfReadyLocked(step);
  }
  if (failure_) return Status::error(Code::kAborted, *failure_);
  if (generation_ != push.generation) return reinitializedWhileHeld();
  if (version_ == step) push.dropped = "stopped";  // the job stopped before this step closed
  return finishPushLocked(push, push.dropped.empty());
}

// async, softsync, ssp --------------------------------------------------------------------------

bool Shard::inWarmupLocked(const HeldPush& push) const {
  return !push.early && policy_.warmup_steps() > 0 && push.id != 0 && version_ < uint64_t(policy_.warmup_steps());
}

Status Shard::holdForWarmupLocked(HeldPush& push) {
  // Worker 0 trains alone until version W; the others wait, then start from its parameters.
  // A push is held for at most the timeout (the worker then pushes again and is held again), so
  // that no call outlives the client's deadline; the held worker counts as heard from.
  const auto limit = std::chrono::duration<double>(policy_.timeout_s());
  auto progress = Clock::now();
  uint64_t seen = version_;
  while (version_ < uint64_t(policy_.warmup_steps()) && !failure_ && !stopJob_) {
    changed_.waitFor(mu_, kTick);
    if (generation_ != push.generation) return reinitializedWhileHeld();
    const auto now = Clock::now();
    workers_[push.id].lastSeen = now;
    if (version_ != seen) {
      seen = version_;
      progress = now;
    } else if (workers_[0].done || workers_[0].lost || now - progress > limit) {
      break;  // worker 0 will not finish the warm-up: go on without it
    }
    if (now - push.arrived > limit) break;
  }
  if (failure_) return Status::error(Code::kAborted, *failure_);
  push.dropped = "warmup";
  push.reply->set_staleness(stalenessLocked(push));
  stats_.set_dropped_warmup(stats_.dropped_warmup() + 1);
  return finishPushLocked(push, false);
}

void Shard::absorbLocked(const HeldPush& push, float scale) {
  if (policy_.mode() == wire::MODE_SOFTSYNC) {
    if (push.early) {
      pendingCount_ += 1;
    } else {
      accumulateLocked(push.grad, scale);
    }
    if (pendingCount_ >= int(policy_.softsync())) applyPendingLocked();
  } else if (push.early) {
    finishUpdateLocked();
  } else {
    applyLocked(push.grad, scale);
  }
}

Status Shard::holdSspLocked(HeldPush& push) {
  const uint32_t id = push.id;
  workers_[id].clock += 1;
  workers_[id].held = true;
  const int64_t bound = int64_t(policy_.staleness_bound());
  bool told = false;
  while (!failure_ && !stopJob_) {
    const auto now = Clock::now();
    workers_[id].lastSeen = now;
    markLostLocked(now);
    const int64_t slowest = slowestClockLocked();
    if (workers_[id].clock - slowest <= bound) break;
    if (options_.onHeld && !told) options_.onHeld(id, workers_[id].clock, slowest);
    told = true;
    changed_.waitFor(mu_, kTick);
    if (generation_ != push.generation) return reinitializedWhileHeld();
  }
  workers_[id].held = false;
  workers_[id].clock -= 1;  // finishPushLocked counts it
  if (failure_) return Status::error(Code::kAborted, *failure_);
  return Status::Ok();
}

Status Shard::pushAsyncLocked(HeldPush& push) {
  if (inWarmupLocked(push)) return holdForWarmupLocked(push);
  // A stream applied as it arrived keeps the staleness, and so the scale, of when it began.
  const int64_t t = push.early ? push.streamed->tau : stalenessLocked(push);
  push.reply->set_staleness(t);
  if (!push.early && policy_.max_staleness() >= 0 && t > policy_.max_staleness()) {
    push.dropped = "stale";
    stats_.set_dropped_stale(stats_.dropped_stale() + 1);
  } else {
    const float scale = (policy_.staleness_lr() == wire::STALENESS_LR_INVERSE && t > 1) ? 1.0f / float(t) : 1.0f;
    noteStalenessLocked(t);
    stats_.set_applied(stats_.applied() + 1);
    absorbLocked(push, scale);
  }
  if (policy_.mode() == wire::MODE_SSP) {
    if (Status s = holdSspLocked(push); !s.ok()) return s;
  }
  return finishPushLocked(push, push.dropped.empty());
}

}  // namespace cohort::ps
