// What `cohort compare` and `cohort sweep` run: configurations of `cohort train` (a scheme, its
// processes and its options), checked against train's own option set, turned into jobs for the
// runner. Torch-free.
#pragma once

#include "base/scheme.h"

#include "experiment/runner.h"

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace cohort::experiment {

class EmulatedNetwork;
struct RemoteHosts;

// `cohort train`'s long option names (without "--"), each with whether it takes a value (false: a
// flag). Made by the CLI from the train command itself, so it is always the real set.
struct OptionCatalog {
  std::map<std::string, bool> takesValue;

  // "eval_every" -> "eval-every". Throws InvalidArgument "WHERE: unknown option 'NAME' (see cohort
  // train --help)" for a name train does not know, and for the ones compare and sweep set
  // themselves (metrics, progress, config, help).
  std::string check(const std::string& name, const std::string& where) const;
};

// One option as train gets it: {"--lr", "0.1"}; a flag set to true is {"--resume", ""}.
using TrainArgs = std::vector<std::pair<std::string, std::string>>;

// Sets (or replaces) an option.
void setArg(TrainArgs& args, const std::string& flag, const std::string& value);
const std::string* findArg(const TrainArgs& args, const std::string& flag);

// `args` less the flags that do nothing under `scheme` and `psMode` (base/scheme.h's whereFlagActs),
// which cohort train refuses: what options shared by the runs of many schemes mean to one of them.
// psMode "" is train's default, async.
TrainArgs withoutFlagsOfOtherSchemes(const TrainArgs& args, Scheme scheme, const std::string& psMode);

struct Configuration {
  std::string name;
  Scheme scheme = Scheme::kLocal;  // train's --strategy
  int workers = 1;  // processes of train (pipeline: stages x replicas)
  int shards = 0;   // parameter-server shards (cohort launch --ps)
  TrainArgs options;  // besides --strategy
  bool asynchronous() const;  // its updates have a staleness: ps async/softsync/ssp, gossip
  int replicas() const;       // copies of the model that share the data
};

// The seeds' set: local, allreduce, average K=4 and 16, ps sync, sync with a backup worker, async,
// softsync, ssp, gossip, pipeline; with `codec` other than "none", every scheme that compresses
// (allreduce, average, ps, gossip) a second time with it.
std::vector<Configuration> defaultConfigurations(int workers, const std::string& codec);

// A comparison file: top-level keys are train options shared by every configuration, and each
// [[configuration]] table names one: name, strategy, workers, ps, and train options. Throws
// InvalidArgument with the file, the configuration and the key for an unknown option or scheme.
struct CompareFile {
  TrainArgs shared;
  std::vector<Configuration> configurations;
};
CompareFile readCompareFile(const std::string& path, const OptionCatalog& catalog);

// How long every configuration trains: exactly one of them is positive.
struct Budget {
  int64_t epochs = 0;
  int64_t steps = 0;     // per process
  int64_t examples = 0;  // all replicas together
  double seconds = 0;    // wall-clock: train's --max-seconds (stops at the first evaluation after it)
};

struct PlanOptions {
  std::string binary;  // the cohort executable
  std::string dir;     // the runner's folder
  TrainArgs shared;    // model, data, seed, batch, ... (a configuration's own options win)
  Budget budget;
  int64_t trainExamples = 60000;  // the training set's size (with any --validation examples in it)
  int evaluations = 10;           // evaluations per run (at least the final one); per epoch under
                                  // a seconds budget, whose runs' lengths are not known before
  int runs = 1;
  // When set, every process of a distributed configuration runs in its own namespace of this
  // network, started by the runner with the variables `cohort launch` would set (TF_CONFIG for the
  // parameter server), instead of under `cohort launch`.
  const EmulatedNetwork* network = nullptr;
  // When set, every process of every configuration runs on one of these hosts through its remote
  // shell (experiment/remote.h), with the variables `cohort launch` would set. Not with `network`.
  const RemoteHosts* hosts = nullptr;
};

// The job of run r (1-based) of a configuration: "NAME.rR". Runs alternate: run 1 of every
// configuration, then run 2, ...
std::string jobId(const Configuration& c, int run);
std::vector<JobSpec> planJobs(const std::vector<Configuration>& configurations, const PlanOptions& options);

// The training command of a configuration (what its job runs, under `cohort launch` when it has
// more than one process), for the report.
std::vector<std::string> trainCommand(const Configuration& c, const PlanOptions& options, const std::string& metricsPath);

// argv of `cohort launch -n WORKERS [--ps SHARDS] -- TRAIN...`, or TRAIN itself for one process.
std::vector<std::string> launchArgv(const std::string& binary, int workers, int shards, std::vector<std::string> train);

// The examples one epoch of a configuration trains on: options.trainExamples less the ones its
// --validation (its own, else the shared one) holds out. Throws InvalidArgument naming the
// configuration when --validation is not a count below options.trainExamples.
int64_t epochExamples(const Configuration& c, const PlanOptions& options);

// Steps of one process per epoch: ceil(floor(examples / replicas) / batch).
int64_t stepsPerEpoch(int64_t examples, int replicas, int64_t batch);

// The number of training examples of a --data value: fashion-mnist 60000, synthetic[:N] N,
// mnist:DIR from its label file's header. Throws InvalidArgument / IoError naming the problem.
int64_t trainingExamples(const std::string& data);

}  // namespace cohort::experiment
