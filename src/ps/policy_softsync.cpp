// softsync (update_policy.h): async's remedies, the pushes gathered into groups of `softsync`.
#include "ps/update_policy.h"

namespace cohort::ps {

void SoftSyncPolicy::absorb(Shard& shard, const Shard::HeldPush& push, float scale) const {
  if (push.early) {
    shard.pendingCount_ += 1;  // its pieces are in
  } else {
    shard.accumulateLocked(push.grad, scale);
  }
  if (shard.pendingCount_ >= int(policy_.softsync())) shard.applyPendingLocked();
}

Shard::Stream::Plan SoftSyncPolicy::absorbPlan() const { return Shard::Stream::Plan::kAccumulate; }

}  // namespace cohort::ps
