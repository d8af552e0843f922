// sync (update_policy.h): each step gathered from the live workers, its pushers held until it
// closes, and a worker lost meanwhile failing the shard unless there are backup workers.
#include "base/clock.h"
#include "ps/shard_internal.h"
#include "ps/update_policy.h"

#include <algorithm>

namespace cohort::ps {

using namespace shard_internal;

Status SyncPolicy::push(Shard& shard, Shard::HeldPush& push) const {
  if (isLate(shard, push)) return dropLate(shard, push);
  if (push.early) {
    shard.pendingCount_ += 1;  // its pieces are in
  } else {
    shard.accumulateLocked(push.grad, 1.0f);
  }
  shard.pendingFrom_[push.id] = true;
  shard.workers_[push.id].heldClock = push.request.clock();
  push.reply->set_staleness(0);
  shard.noteStalenessLocked(0);
  shard.stats_.set_applied(shard.stats_.applied() + 1);
  return holdUntilClosed(shard, push, shard.version_);
}

void SyncPolicy::planStream(const Shard& shard, Shard::Stream& stream) const {
  const uint32_t id = stream.request.worker();
  if (stream.request.pulled_version() >= shard.version_ && !shard.pendingFrom_[id]) {
    stream.plan = Shard::Stream::Plan::kAccumulate;
  }
}

bool SyncPolicy::stillGathering(const Shard& shard, const Shard::Stream& stream) const {
  return shard.version_ == stream.version;
}

bool SyncPolicy::isLate(const Shard& shard, const Shard::HeldPush& push) const {
  // A gathered stream is late when its step closed while it arrived (some of its pieces made it).
  if (push.early) return shard.version_ != push.streamed->version;
  return push.request.pulled_version() < shard.version_ || shard.pendingFrom_[push.id];
}

Status SyncPolicy::dropLate(Shard& shard, Shard::HeldPush& push) const {
  push.dropped = "late";
  push.reply->set_staleness(shard.stalenessLocked(push));
  shard.stats_.set_dropped_late(shard.stats_.dropped_late() + 1);
  return shard.finishPushLocked(push, false);
}

Status SyncPolicy::holdUntilClosed(Shard& shard, Shard::HeldPush& push, uint64_t step) const {
  closeStepIfReady(shard, step);
  while (shard.version_ == step && !shard.failure_ && !shard.stopJob_) {
    shard.changed_.waitFor(shard.mu_, kTick);
    if (shard.generation_ != push.generation) return reinitializedWhileHeld();
    failOnLostWorkers(shard, step);
    if (shard.failure_) break;
    closeStepIfReady(shard, step);
  }
  if (shard.failure_) return Status::error(Code::kAborted, *shard.failure_);
  if (shard.generation_ != push.generation) return reinitializedWhileHeld();
  if (shard.version_ == step) push.dropped = "stopped";  // the job stopped before this step closed
  return shard.finishPushLocked(push, push.dropped.empty());
}

void SyncPolicy::closeStepIfReady(Shard& shard, uint64_t step) const {
  int live = 0;
  for (const auto& w : shard.workers_) live += (!w.done && !w.lost && !w.finishing) ? 1 : 0;
  const int needed = std::max(1, std::min(int(policy_.workers() - policy_.backup_workers()), live));
  if (shard.version_ != step || shard.pendingCount_ < needed) return;
  for (size_t i = 0; i < shard.workers_.size(); ++i) shard.workers_[i].inClosedStep = shard.pendingFrom_[i];
  shard.applyPendingLocked();
}

void SyncPolicy::failOnLostWorkers(Shard& shard, uint64_t step) const {
  const auto now = shard.now();
  auto& workers = shard.workers_;
  // Workers held in this step are alive: they are waiting on us.
  for (size_t i = 0; i < workers.size(); ++i) {
    if (shard.pendingFrom_[i]) workers[i].lastSeen = std::max(workers[i].lastSeen, now);
  }
  shard.markLostLocked(now);
  std::string missing;
  for (size_t i = 0; i < workers.size(); ++i) {
    if (workers[i].lost && !shard.pendingFrom_[i]) missing += (missing.empty() ? "" : ", ") + std::to_string(i);
  }
  if (missing.empty() || policy_.backup_workers() > 0) return;
  shard.failure_ = "worker " + missing + " sent no gradient for step " + std::to_string(step) + " within " +
                   seconds(policy_.timeout_s()) +
                   ": it is lost, and sync mode needs every worker (--backup-workers K lets the others go on)";
  shard.log(*shard.failure_);
  shard.changed_.notifyAll();
}

}  // namespace cohort::ps
