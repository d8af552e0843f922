// `cohort launch`'s environment for its children (cli/launch.h, "Environment", "Ports",
// "Parameter servers", "The launcher channel"): what every child shares, what each one's place in
// the job adds, and the job's TF_CONFIG. Pure functions of the options and the ports told so far.
#pragma once

#include "cli/launch.h"

#include <map>
#include <string>
#include <vector>

namespace cohort::cli {

// Where a child finds its launcher channel (COHORT_LAUNCH_FD).
constexpr int kChannelFd = 3;

using EnvChanges = std::map<std::string, std::string>;

// The launcher's variables no child inherits: the rank assignments of other launchers (torchrun's,
// mpirun's, srun's, TF_CONFIG), as SubprocessOptions::unsetEnv patterns.
std::vector<std::string> assignedElsewhere();

// What every child of the job gets on top of the launcher's environment: a thread budget of
// max(1, cores / processes) unless the launcher's environment sets OMP_NUM_THREADS, and the job's
// secret (a random one) unless it sets COHORT_AUTH_TOKEN.
EnvChanges sharedChildEnv(int processes);

// Child `index` of the job: ranks 0 .. processes-1, then the shards, then the evaluator.
struct ChildPlace {
  int index = 0;
  bool server = false;     // a parameter-server shard
  bool evaluator = false;  // the evaluator task
  bool restartedAlone = false;
};

// The job's ports as the launcher knows them now: MASTER_PORT (0 until the chief told it) and each
// shard's (-1 or 0 until it told it).
struct JobPorts {
  int master = 0;
  std::vector<int> shards;
};

// What child `place` gets on top of the shared environment: RANK, WORLD_SIZE, LOCAL_RANK and
// LOCAL_WORLD_SIZE (workers), MASTER_ADDR, MASTER_PORT, COHORT_LAUNCH_FD, COHORT_RESTART_COUNT,
// COHORT_RESTARTED_ALONE (when restarted alone), TF_CONFIG (with --ps or --evaluator).
EnvChanges childEnv(const LaunchOptions& options, const ChildPlace& place, const JobPorts& ports, int restarts);

// The job's TF_CONFIG for child `place`: rank 0 is the chief at the rendezvous port, the shards at
// the ports they told; a port not known yet is 0 (a shard's own, the chief's own without --port:
// it binds any free port and tells it). The other workers and the evaluator listen on nothing:
// their port is 0. An IPv6 host is bracketed ("[::1]:port").
std::string tfConfig(const LaunchOptions& options, const ChildPlace& place, const JobPorts& ports);

}  // namespace cohort::cli
