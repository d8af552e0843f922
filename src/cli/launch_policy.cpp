#include "cli/launch_policy.h"

namespace cohort::cli {

std::optional<WorkerLoss> parseWorkerLoss(std::string_view word) {
  if (word == "stops-group") return WorkerLoss::kStopsGroup;
  if (word == "tolerated") return WorkerLoss::kTolerated;
  if (word == "rejoins") return WorkerLoss::kRejoins;
  return std::nullopt;
}

std::string_view workerLossName(WorkerLoss loss) {
  switch (loss) {
    case WorkerLoss::kStopsGroup: return "stops-group";
    case WorkerLoss::kTolerated: return "tolerated";
    case WorkerLoss::kRejoins: return "rejoins";
  }
  return "stops-group";
}

bool shardDiedBeforeItsFirstCheckpoint(const FailedProcess& failed) {
  return failed.kind == ProcessKind::kShard && failed.scheme != WorkerLoss::kStopsGroup && failed.writesCheckpoints &&
         !failed.hasCheckpoint;
}

FailureAction onFailure(const FailedProcess& failed) {
  const bool tolerant = failed.scheme != WorkerLoss::kStopsGroup;
  const bool canRestart = failed.restartsLeft > 0 && !failed.finished;
  switch (failed.kind) {
    case ProcessKind::kWorker:
      if (!tolerant) break;
      return failed.scheme == WorkerLoss::kRejoins && canRestart ? FailureAction::kRestartProcess
                                                                  : FailureAction::kGoOn;
    case ProcessKind::kShard:
      if (tolerant && failed.writesCheckpoints && !shardDiedBeforeItsFirstCheckpoint(failed) && canRestart) {
        return FailureAction::kRestartProcess;
      }
      break;
    case ProcessKind::kChief:
      break;
  }
  return canRestart ? FailureAction::kRestartGroup : FailureAction::kEndJob;
}

}  // namespace cohort::cli
