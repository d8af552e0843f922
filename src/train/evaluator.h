// The evaluator task (TF_CONFIG type "evaluator", `cohort launch --evaluator`): a process that
// watches the chief's checkpoint directory and evaluates every checkpoint once, so that the
// workers never pause for evaluation.
//
// The files it shares with the chief, all in the checkpoint directory:
//   ckpt-<step>.ckpt      written by the chief (atomic rename: a file that is listed is whole); with
//                         an evaluator in the cluster the chief writes one at every evaluation
//                         point and does not prune those the evaluators have not recorded yet
//   evaluator-<k>.jsonl   evaluator k's record: one `eval` event per checkpoint evaluated, appended
//                         and flushed after the evaluation, then a `done` event. A restarted
//                         evaluator reads it and skips the steps it holds (a line cut by a kill is
//                         dropped), so each checkpoint is recorded exactly once
//   training-done         written (atomic rename) by the chief after its last checkpoint:
//                         {"step": N, "job": J} (J: trainingDoneJob, below). The evaluator exits
//                         once it has recorded every checkpoint up to N that is still on disk.
// A fresh run needs a checkpoint directory of its own (or --resume): the evaluator cannot tell an
// earlier run's files from this run's.
#pragma once

#include "train/trainer.h"

#include <cohort/cluster.h>

#include <cstdint>
#include <optional>
#include <set>
#include <string>

namespace cohort {

std::string evaluatorRecordPath(const std::string& checkpointDir, int index);
std::string trainingDoneMarkerPath(const std::string& checkpointDir);

// The steps evaluator `index` has recorded (empty when it has no record yet).
std::set<int64_t> evaluatedSteps(const std::string& checkpointDir, int index);

// The highest step up to which every evaluator of the cluster has recorded every checkpoint
// (-1 when one has recorded none): what the chief may prune.
int64_t evaluatedByAll(const std::string& checkpointDir, int evaluators);

// The end-of-training marker names the job it is of: a digest of the job's secret, else of its
// identity (ClusterSpec::storeKey), "" for a job with neither. An evaluator takes a marker of another
// job for none: a resumed run is a new job (cohort launch makes a new secret), and its evaluator must
// not stop at the earlier run's marker, which its chief removes only once it has started.
std::string trainingDoneJob(const ClusterSpec& cluster);
void writeTrainingDone(const std::string& checkpointDir, int64_t step, const std::string& job);
// nullopt: no marker, or one of another job (a marker without a job, or a job without one, matches).
std::optional<int64_t> readTrainingDone(const std::string& checkpointDir, const std::string& job);
void removeTrainingDone(const std::string& checkpointDir);

struct EvaluatorOptions {
  double idleTimeoutSeconds = 600;  // no new checkpoint and no end marker for this long: fail
  double pollSeconds = 0.2;
  // Testing (--test-kill-evaluator-after N): SIGKILL itself right after recording the N-th
  // checkpoint of its record. Once per record: a restarted evaluator finds N there and goes on.
  int64_t testKillAfter = 0;
};

// Runs the evaluator task `cluster.rank` with the training command's options (the same command
// as the workers, TF's convention). Returns the exit status. Throws InvalidArgument when
// options.checkpointDir is empty, TimeoutError when the idle timeout passes.
int runEvaluator(const TrainOptions& options, const ClusterSpec& cluster, const EvaluatorOptions& evaluator);

}  // namespace cohort
