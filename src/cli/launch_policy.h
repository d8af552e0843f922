// What `cohort launch` does when one of its processes fails: the failure policy per scheme.
//
// The launcher cannot tell from the command line which scheme runs (a --config file, a wrapper
// script or a user's own program may choose it), so the processes say it themselves over the
// launcher's channel (base/launcher_channel.h): the chief says what the scheme survives
// ("fault-policy ..."), a shard that writes checkpoints says so ("shard-checkpoints"). Until the
// chief has spoken, and for any program that never does, a failure stops the whole group: the
// behaviour of a synchronous scheme, and of every launcher that knows nothing of the schemes.
//
// The rules (restarts = what is left of --max-restarts):
//   a worker other than the chief, when the scheme tolerates its loss (ps async, softsync, ssp, sync
//     with backup workers; gossip): the others go on (the chief names it at the end); when the
//     scheme also lets it rejoin (the asynchronous ps modes) and restarts > 0, it is restarted
//     alone and resumes at its clock on the shards;
//   a shard: restarted alone from its checkpoint when the scheme tolerates a lost worker (the
//     workers wait for it and retry), it writes checkpoints, has written or restored one already
//     and restarts > 0; else as the chief (one killed before its first checkpoint would come back
//     with no state, waiting for the chief's Init: the group is restarted instead);
//   the chief, or any process of a scheme that does not tolerate losses: the group is restarted
//     (every process, a fresh rendezvous on a new port, resuming from the newest checkpoint) when
//     restarts > 0, else the job ends with the failure's status;
//   a process that said "finished" before failing (its run is recorded; its final checkpoint could
//     not be written): the job ends with the failure's status, restarts or not: a restart would
//     train again from an older checkpoint only to fail on the same disk.
#pragma once

#include <optional>
#include <string_view>

namespace cohort::cli {

// What the job's scheme does when a worker other than the chief is lost.
enum class WorkerLoss {
  kStopsGroup,  // synchronous: every step needs every worker
  kTolerated,   // the others go on without it
  kRejoins,     // tolerated, and a restarted worker takes up its work again
};

// The value of a "fault-policy" line; nullopt for a word the launcher does not know.
std::optional<WorkerLoss> parseWorkerLoss(std::string_view word);
std::string_view workerLossName(WorkerLoss loss);

enum class ProcessKind { kChief, kWorker, kShard };

struct FailedProcess {
  ProcessKind kind = ProcessKind::kWorker;
  WorkerLoss scheme = WorkerLoss::kStopsGroup;  // as the chief said, kStopsGroup until it has
  bool writesCheckpoints = false;               // a shard that said "shard-checkpoints"
  bool hasCheckpoint = false;                   // a shard that said "shard-has-checkpoint" (in this run)
  int restartsLeft = 0;
  bool finished = false;  // it said "finished" (its run is recorded): no restart, whatever is left
};

enum class FailureAction {
  kEndJob,          // stop the others; the job's status is the failure's
  kGoOn,            // the others carry on; the launcher notes the loss
  kRestartProcess,  // start this process again, alone, with the same environment
  kRestartGroup,    // stop every process, then start all again on a new port
};

FailureAction onFailure(const FailedProcess& failed);

// A shard of a scheme that restarts shards alone, but that died before its first checkpoint: it
// would come back with no state, so onFailure restarts the group instead (the launcher says why).
bool shardDiedBeforeItsFirstCheckpoint(const FailedProcess& failed);

}  // namespace cohort::cli
