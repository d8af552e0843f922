// The factory of the update policies (update_policy.h), and what they share by default.
#include "ps/update_policy.h"

namespace cohort::ps {

std::shared_ptr<const UpdatePolicy> UpdatePolicy::make(const wire::Policy& policy) {
  switch (policy.mode()) {
    case wire::MODE_SYNC: return std::make_shared<SyncPolicy>(policy);
    case wire::MODE_SOFTSYNC: return std::make_shared<SoftSyncPolicy>(policy);
    case wire::MODE_SSP: return std::make_shared<SspPolicy>(policy);
    default: return std::make_shared<AsyncPolicy>(policy);  // MODE_ASYNC; checkPolicy refuses the others
  }
}

bool UpdatePolicy::stillGathering(const Shard&, const Shard::Stream&) const { return true; }

}  // namespace cohort::ps
