// ssp (update_policy.h): applied as async, then held while the worker is too far ahead.
#include "base/clock.h"
#include "ps/shard_internal.h"
#include "ps/update_policy.h"

#include <algorithm>
#include <climits>

namespace cohort::ps {

using namespace shard_internal;

Status SspPolicy::holdAfterAbsorbing(Shard& shard, Shard::HeldPush& push) const {
  shard.workers_[push.id].clock += 1;
  shard.workers_[push.id].held = true;
  const int64_t bound = int64_t(policy_.staleness_bound());
  bool told = false;
  while (!shard.failure_ && !shard.stopJob_) {
    const auto now = shard.now();
    shard.workers_[push.id].lastSeen = now;
    shard.markLostLocked(now);
    const int64_t slowest = slowestClock(shard);
    const int64_t clock = shard.workers_[push.id].clock;
    if (clock - slowest <= bound) break;
    if (shard.options_.onHeld && !told) shard.options_.onHeld(push.id, clock, slowest);
    told = true;
    shard.changed_.waitFor(shard.mu_, kTick);
    if (shard.generation_ != push.generation) return reinitializedWhileHeld();
  }
  shard.workers_[push.id].held = false;
  shard.workers_[push.id].clock -= 1;  // finishPushLocked counts it
  if (shard.failure_) return Status::error(Code::kAborted, *shard.failure_);
  return Status::Ok();
}

Status SspPolicy::finish(Shard& shard, Shard::HeldPush& push, bool applied) const {
  const Status s = shard.finishPushLocked(push, applied);
  recordClockGap(shard);
  return s;
}

int64_t SspPolicy::slowestClock(const Shard& shard) {
  int64_t slowest = INT64_MAX;
  for (const auto& w : shard.workers_) {
    if (!w.done && !w.lost && !w.finishing) slowest = std::min(slowest, w.clock);
  }
  return slowest;
}

void SspPolicy::recordClockGap(Shard& shard) {
  const int64_t slowest = slowestClock(shard);
  if (slowest == INT64_MAX) return;
  int64_t fastest = INT64_MIN;
  for (const auto& w : shard.workers_) {
    if (!w.done && !w.lost && !w.finishing && !w.held) fastest = std::max(fastest, w.clock);
  }
  if (fastest != INT64_MIN) {
    shard.stats_.set_max_clock_gap(std::max(shard.stats_.max_clock_gap(), fastest - slowest));
  }
}

}  // namespace cohort::ps
