// What a process tells `cohort launch` about itself, for what the launcher cannot see from outside:
// which losses its scheme survives, whether a shard can come back from a checkpoint, and why it
// failed. The launcher gives every child the write end of a pipe and names it in
// COHORT_LAUNCH_FD; the messages are single lines (cli/launch.h lists them). Outside the launcher
// (no COHORT_LAUNCH_FD) every call is a no-op, so any program, under any launcher, may call them.
#pragma once

#include <string_view>

namespace cohort::launcher {

// "fault-policy <stops-group|tolerated|rejoins>": what this job's scheme does when a worker other
// than the chief dies (said by the chief; see cli/launch_policy.h).
void tellFaultPolicy(std::string_view policy);

// "shard-checkpoints": this parameter-server shard writes checkpoints and restores them when it is
// started again, so the launcher may restart it alone.
void tellShardCheckpoints();

// "shard-has-checkpoint": this shard has a checkpoint on disk to restore (it restored one or wrote
// one). Until it says so, a shard restarted alone would have no state and wait for a chief's Init
// that a running chief never sends again, so the launcher restarts the group instead. Said once.
void tellShardHasCheckpoint();

// "error <one line>": the reason this process is about to exit with a failure.
void tellError(std::string_view message);

// "finished": this process ran every step and recorded its result (the done event); a failure
// after this is in the run's wrap-up (a final checkpoint on a full disk), which a restart from an
// older checkpoint would only repeat, so the launcher ends the job with it instead of restarting.
void tellFinished();

// "port <P>": this process listens on port P, which it got by binding port 0 (the chief's
// rendezvous store, a shard's server). The launcher starts the processes that need this address
// only once it knows it, so no port is ever chosen by one process and bound by another. Only the
// first port a process tells counts.
void tellPort(int port);

// "port none": this process listens on nothing the others need (a chief whose scheme has no
// rendezvous store); the launcher may start them. A no-op once a port was told.
void tellNoPort();

}  // namespace cohort::launcher
