#include "base/thread_annotations.h"

#include <cohort/communicator.h>
#include <cohort/device.h>
#include <cohort/error.h>
#include <cohort/job.h>

#include <string>
#include <vector>

namespace cohort {

struct COHORT_LOCAL Job::State {
  ClusterSpec spec;
  JobOptions options;
  c10::Device device{c10::kCPU};
  Mutex mutex;
  std::shared_ptr<Communicator> comm GUARDED_BY(mutex);  // connected on first use
  bool given = false;  // comm came from fromCommunicator()
};

namespace {

// The communicators this process has joined through a Job, by (master, rank): a second Job of the
// same process and rank would start a second store on the chief's port ("address already in use:
// another job uses the port") or wait out the timeout for a Gloo group that cannot form.
// Tests that run ranks as threads of one process join as different ranks.
struct Joined {
  std::string key;
  std::weak_ptr<Communicator> comm;
  bool connecting = true;  // the connect is under way (the lock is not held across it)
};
Mutex joinedMutex;
std::vector<Joined> joined GUARDED_BY(joinedMutex);

// Reserves `key` for a connect; throws InvalidArgument when this process holds it already.
void reserveJoin(const std::string& key) {
  MutexLock lock(joinedMutex);
  std::erase_if(joined, [](const Joined& j) { return !j.connecting && j.comm.expired(); });
  for (const Joined& j : joined) {
    COHORT_CHECK(j.key != key, InvalidArgument, "this process has joined the job already (", key,
                 ") through another Job: copy that Job (copies share its communicator) instead of making a second "
                 "one, or destroy everything made from the first before");
  }
  joined.push_back({key, {}, true});
}

// The reservation's outcome: the communicator, or null when the connect failed.
void settleJoin(const std::string& key, const std::shared_ptr<Communicator>& comm) {
  MutexLock lock(joinedMutex);
  for (auto j = joined.begin(); j != joined.end(); ++j) {
    if (j->key != key || !j->connecting) continue;
    if (comm == nullptr) {
      joined.erase(j);
    } else {
      j->comm = comm;
      j->connecting = false;
    }
    return;
  }
}

std::string joinKey(const ClusterSpec& spec) {
  return spec.master.host + ":" + std::to_string(spec.master.port) + " rank " + std::to_string(spec.rank);
}

}  // namespace

Job Job::fromEnvironment(const JobOptions& options) { return fromSpec(resolveClusterFromEnvironment(), options); }

Job Job::fromSpec(const ClusterSpec& spec, const JobOptions& options) {
  COHORT_CHECK(options.timeout.count() > 0, InvalidArgument, "JobOptions::timeout must be positive, got ",
               options.timeout.count(), " ms");
  auto state = std::make_shared<State>();
  state->spec = spec;
  state->options = options;
  state->device = resolveDevice(options.device, spec.localRank);
  return Job(std::move(state));
}

Job Job::fromCommunicator(std::shared_ptr<Communicator> comm) {
  COHORT_CHECK(comm != nullptr, InvalidArgument, "Job::fromCommunicator needs a communicator, got null");
  auto state = std::make_shared<State>();
  state->spec.rank = comm->rank();
  state->spec.worldSize = comm->worldSize();
  state->spec.localRank = comm->localRank();
  state->spec.source = "communicator";
  state->options.timeout = comm->options().timeout;
  state->options.backend = comm->options().backend;
  state->options.env = comm->options().env;
  // The process's GPU, as fromSpec() picks it: by its local rank, not its rank in this group (a
  // pipeline's stage group, a sub-group of a larger job).
  state->device = resolveDevice("auto", state->spec.localRank);
  {
    MutexLock lock(state->mutex);  // no other thread sees state yet: the lock is for the analysis
    state->comm = std::move(comm);
  }
  state->given = true;
  return Job(std::move(state));
}

Job Job::single() { return fromSpec(ClusterSpec{}); }

const ClusterSpec& Job::cluster() const { return state_->spec; }
int Job::rank() const { return state_->spec.rank; }
int Job::worldSize() const { return state_->spec.worldSize; }
std::chrono::milliseconds Job::timeout() const { return state_->options.timeout; }
c10::Device Job::device() const { return state_->device; }
CommBackend Job::backend() const { return state_->options.backend; }
Env& Job::env() const { return envOrStandard(state_->options.env); }

std::shared_ptr<Communicator> Job::communicator() const {
  MutexLock lock(state_->mutex);
  if (state_->comm || state_->spec.worldSize <= 1) return state_->comm;
  COHORT_CHECK(state_->spec.role == Role::kWorker, InvalidArgument, "this process is not a worker (",
               describe(state_->spec), "): only workers join the workers' communicator");
  const std::string key = joinKey(state_->spec);
  reserveJoin(key);
  try {
    state_->comm = Communicator::connect(state_->spec, CommOptions{.timeout = state_->options.timeout,
                                                                   .backend = state_->options.backend,
                                                                   .env = state_->options.env});
  } catch (...) {
    settleJoin(key, nullptr);
    throw;
  }
  settleJoin(key, state_->comm);
  return state_->comm;
}

}  // namespace cohort
